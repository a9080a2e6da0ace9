"""The demo users ``alice`` and ``bob`` (passwords ``alice`` and ``bob``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.hashers import make_password
from django.db import migrations

USERS = ("alice", "bob")


def create_users(apps: Any, schema_editor: Any) -> None:
    User = apps.get_model("auth", "User")
    for name in USERS:
        User.objects.update_or_create(username=name, defaults={"password": make_password(name)})


def delete_users(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "User").objects.filter(username__in=USERS).delete()


class Migration(migrations.Migration):
    dependencies = [("payments", "0001_initial")]

    operations = [migrations.RunPython(create_users, delete_users)]
