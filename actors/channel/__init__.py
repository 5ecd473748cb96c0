"""The channel between an ingress replica and the engine replicas: how a request's outputs travel.

An ingress opens one engine call per request (`generate`, on the replica the router picks). The
call's first item carries the request's first outputs and names the replica; after it, the
outputs of all that ingress's requests on that replica travel together, one message per engine
step, on whichever of its open calls carries at the moment. Each call stays open until its
request is done, so Serve's request counts (routing, autoscaling, draining) stay true.

- `protocol`: what the calls carry (EncodedRequest, FirstItem, MuxMessage), the call keywords
  for the routers, EngineUnavailableError.
- `ingress`: the ingress end, the API the HTTP layer uses: `IngressChannel.open(requests)` ->
  one `RequestStream` per request (its first outputs, `next()`, `abort()`, `close()`).
- `failover` (ingress end): a call refused before its first item goes to another replica.
- `demux` (ingress end): messages sorted back to each request, in order per replica.
- `mux` (engine end): the engine replica's buffer of an ingress's outputs, and who carries it.
"""
