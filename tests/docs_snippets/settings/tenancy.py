def tenant_account(request):  # ACCOUNT: the tenant, not the user
    return f"tenant-{request.user.tenant_id}" if request.user.is_authenticated else None


tenants = {"tenant-7": "Acme Ltd"}  # yours: a Tenant model


def tenant_name(account):  # ACCOUNT_DISPLAY: "tenant-7" -> "Acme Ltd (tenant-7)"
    return f"{tenants.get(account, '?')} ({account})"


def accounts_named(term):  # ACCOUNT_SEARCH: "Acme" -> ["tenant-7"]
    term = term.lower()
    return [account for account, name in tenants.items() if term in name.lower()]


IDEMPOTENCY = {
    "ACCOUNT": tenant_account,
    "ACCOUNT_DISPLAY": tenant_name,
    "ACCOUNT_SEARCH": accounts_named,
}
