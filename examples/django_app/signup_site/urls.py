from django.urls import path

from signup_site.views import subscribe

urlpatterns = [path("subscribe", subscribe)]
