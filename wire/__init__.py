"""What every role's wire shares: the one error base, and the HTTP client base each role's client builds on.

    errors     `WeirError`: a caller's mistake with a stable ``code`` (every library's error tree derives from it)
    client     `RoleClient` / `AsyncRoleClient`: token, timeouts, retries with jitter, a refusal mapped to
               `RoleRefused`, an answer read through its record (`AnswerMismatch` naming the field and the role)
    backoff    `Backoff`: every retry loop's pauses, exponential with full jitter, capped (standard library only)
    transport  `ConnectRetry` / `AsyncConnectRetry`: ``httpx`` transports retrying refused connections with it
    aiohttp_transport  `AiohttpPoolTransport`: the async clients' requests through aiohttp's connection pool
    pooled_client  `PooledAsyncClient`: every role's async client, and its short way for a call answered whole

The records themselves live with the library behind each role (`preprocess.api`, `encoders.api`,
`engines.api`, `experience.api`, `rollout.api`) and so do the clients (`<library>.client`): the server
validates with the same classes its callers build and read.
"""
