"""Mixed precision: the dynamic loss scaler for fp16."""
