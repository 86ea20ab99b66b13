"""The DHT side of the swarm: ``dht`` (peers, the rendezvous), ``addresses``, ``identity``, ``ownership`` (records only
their owner can change), the records themselves (``progress``, ``status``, ``budget``: round tokens), ``swarm_key``
(sealed records of a keyed swarm) and ``fingerprint`` (the model's, in every key)."""
