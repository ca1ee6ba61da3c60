"""Public ops: argument checks, backend choice and exact gradients."""
