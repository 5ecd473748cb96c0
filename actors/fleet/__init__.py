"""What spans the engine replicas, run inside each ingress replica: Serve RequestRouters for the
engine deployment (`router`: prefix affinity, power of two). The failover and the output demux
that also run there are the channel's ingress end (actors/channel/).
"""
