"""Our calls to the providers: charges and refunds created, relayed from the outbox (one at a
time or in batches), queried when unresolved, recorded as provider calls, behind a circuit breaker and the
merchant's idempotency keys. It may import every wing below it, inbound included (a synchronous answer is
verified as a notification is).
"""
