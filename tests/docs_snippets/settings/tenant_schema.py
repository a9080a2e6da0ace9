def schema_tenant(request):  # with django-tenants: the tenant its middleware found
    return request.tenant.schema_name


IDEMPOTENCY = {"TENANT": schema_tenant}
