"""A relay for ranks nobody can dial: ``diloco dht --relay-ports`` leases ports of its own to them (``server``), and
such a rank takes the connections that arrive there over connections it opens itself (``lease``)."""
