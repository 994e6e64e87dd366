"""Reading a request: its body, its options (one frozen dataclass per model kind),
its image, its protocol. Pure: no TorchServe."""
