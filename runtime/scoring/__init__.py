"""How the host scores a batch on a reward's sandboxes: the client (deadlines, retries, fallbacks), each replica and its
recovery, the transport, and the samples it sends."""
