"""Operations: what an operator runs or looks at (the admin and its overview page, the purge,
the health check).
"""
