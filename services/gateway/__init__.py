"""The gateway (design.md "Data flow of one request"): HTTP and NATS completions in, an
IntakeRequest on the durable intake out, the first token back to the client.

``settings`` (GatewaySettings), ``adapter`` (GatewayService: the micro service and the
completion path), ``idempotency`` (request id → content digest: 409 for an id reused with
another request), ``idempotency_kv`` (the same, shared by every replica: a JetStream KV
bucket), ``app`` (HTTP routes), ``httpserver`` (a small asyncio HTTP/1.1 server),
``main`` (``python -m services.gateway``).
"""
