"""What spans the engine replicas, run inside each ingress replica.

- `router`: Serve RequestRouters for the engine deployment (prefix affinity, power of two).
- `failover`: a request refused before its first token goes to another replica.
- `demux`: the multiplexed outputs of every replica, sorted back to each request.
"""
