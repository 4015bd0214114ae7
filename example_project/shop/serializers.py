from rest_framework import serializers

from example_project.shop.models import Booking


class BookingSerializer(serializers.ModelSerializer):
    class Meta:
        model = Booking
        fields = ["id", "slot", "guests", "created_at"]
