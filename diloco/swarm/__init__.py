"""The swarm: the only package that imports hivemind. It never imports the outer loop (``diloco.outer``), which talks
to it through ``peer.SwarmPeer`` (``start.start_peer`` builds one per rank).

- ``records``: the DHT side: the DHT peer and its addresses, identities, owned and sealed records (progress, status,
  round tokens), the swarm key, the model's fingerprint;
- ``rounds``: the wire side: matchmaking, the layout and schedule of a round of whole groups, the TCP round and its
  frames, the listener and the libp2p tunnel, state transfers, the digest, codecs, screening and aggregation.

Importing the package itself loads no hivemind; neither do the record schemas, the layout, the TCP round, screening
and aggregation.
"""
