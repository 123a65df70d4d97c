"""The machinery every way in shares (`Run`: run directory, run id, secret noise key, ledger)."""
