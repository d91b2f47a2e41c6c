"""shmpipe's transports besides the shared-memory ring ("shm", in
shmpipe.transports.shm): "arrow", "ray" and "queue". Look them up by name with
shmpipe.get_transport(); importing this package imports none of them."""
