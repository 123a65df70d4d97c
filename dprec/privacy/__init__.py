"""Privacy accounting, noise calibration, DP top-k selection and the persistent ledger."""
