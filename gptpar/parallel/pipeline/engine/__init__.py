"""The multi-process pipeline engine (parallel.pp > 1): each rank holds its stages of GPT-2 and executes its
schedule's forward, backward (split into B and W for ZB-H1) and send/receive actions. Unlike one_process/,
stages live in different processes, exchange activations by point-to-point messages and keep two copies of
the tied embedding."""
