from django.urls import path

from tests import recovery_views

urlpatterns = [
    path("pay/", recovery_views.pay),
    path("pay/long-lease/", recovery_views.pay_long_lease),
    path("pay/reconciled/", recovery_views.pay_reconciled),
    path("pay/held/", recovery_views.pay_held),
    path("pay/held-by-path/", recovery_views.pay_held_by_path),
    path("pay/reconciled-by-template/", recovery_views.pay_reconciled_by_template),
    path("pay/reconciled-by-drf/", recovery_views.ReconciledPayView.as_view()),
    path("pay/reconciled-while-renewed/", recovery_views.pay_reconciled_while_renewed),
    path("pay/atomic/", recovery_views.pay_atomic),
    path("pay/taken-over/", recovery_views.pay_taken_over),
    path("beat/", recovery_views.beat),
    path("renewed/", recovery_views.renewed),
]
