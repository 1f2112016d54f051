"""Generated protobuf code for the wire contract (package fl_secure.v1)."""
