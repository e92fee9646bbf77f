"""Platform channels: one package per platform (adapter, sink, rendering), shared helpers beside them."""
