"""Integrations with optional frameworks, one module each.

Each module here is the only one in the package that imports its framework
(``drf`` Django REST framework, ``spectacular`` drf-spectacular, ``celery``
Celery, ``django_tasks`` Django's Tasks framework), and hands the core what
it knows of that framework; the rest of the package imports without them.
"""
