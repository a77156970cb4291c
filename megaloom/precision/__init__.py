"""Mixed precision: the dynamic loss scaler for fp16 (`loss_scaler`) and float8 linear layers (`fp8`)."""
