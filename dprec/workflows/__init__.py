"""The ways in, above models/ and training/: one module per workflow (`ctr`, `seqrec` with
`dp_forward`, `stream`: options, data, model, `run(options) -> summary`) on one shared run (`run`:
directory, id, secret noise key, ledger, summary; `resume`: checkpoints and exact resume) and one
privacy planner (`plan`); the `*_cli` modules only parse arguments and call them."""
