from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class DemoPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2 with few iterations, for the demo users only (see settings)."""

    algorithm = "pbkdf2_sha256_demo"
    iterations = 1000
