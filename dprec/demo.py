"""`dprec demo`: the end-to-end walkthrough run by `make demo` (generate → account → train)."""


def register(subparsers):
  parser = subparsers.add_parser(
      "demo", help="generate a small Criteo-like dataset, account privacy and train on it",
      description="End-to-end demo on an embedded synthetic dataset; prints a JSON summary.")
  parser.add_argument("--out", default="demo_out", help="working directory for generated files")
  parser.add_argument("--rows", type=int, default=20000, help="synthetic rows to generate")
  parser.add_argument("--seed", type=int, default=0, help="random seed")
  parser.set_defaults(func=run)


def run(args):
  raise NotImplementedError("the demo is assembled once the foundation modules land")
