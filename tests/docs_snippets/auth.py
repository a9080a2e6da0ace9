"""The snippets' "your authentication": HTTP Basic, answering 401 without valid
credentials."""

import base64
import binascii
import functools

from django.contrib.auth import authenticate
from django.http import HttpResponse


def api_auth_required(view):
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        try:
            username, _, password = (
                base64.b64decode(credentials).decode().partition(":")
            )
        except (binascii.Error, UnicodeDecodeError):
            username = password = ""
        user = authenticate(request, username=username, password=password)
        if scheme.lower() != "basic" or user is None:
            response = HttpResponse(status=401)
            response["WWW-Authenticate"] = 'Basic realm="api"'
            return response
        request.user = user
        return view(request, *args, **kwargs)

    return wrapper
