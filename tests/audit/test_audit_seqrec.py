"""The seqrec canary audit on tiny synthetic sequences: non-private training is caught (bound
well above 1 at 95%), DPFormer's DP step at ε = 2 is not (bound ≤ 2)."""
import json


from dprec.audit import seqrec
from dprec.workflows.seqrec import SeqRecTrainOptions

CANARIES, EPSILON = 200, 2.0


def _options(sequences_dir, epsilon):
  return SeqRecTrainOptions(model="dpformer", data=sequences_dir, epsilon=epsilon, epochs=10,
                            batch_size=32, max_len=8, dim=16, num_blocks=1, dropout=0.0,
                            learning_rate=1e-2, accountant="rdp", progress=False)


def test_non_private_seqrec_is_caught(sequences_dir, tmp_path):
  summary = seqrec.audit_seqrec(_options(sequences_dir, float("inf")), canaries=CANARIES,
                                scores_file=str(tmp_path / "scores.jsonl"),
                                summary_json=str(tmp_path / "audit.json"))
  assert summary["claimed_epsilon"] is None and summary["epsilon_lower_bound"] > 2.0
  with open(tmp_path / "audit.json", encoding="utf-8") as stream:
    assert json.load(stream)["epsilon_lower_bound"] == summary["epsilon_lower_bound"]
  with open(tmp_path / "scores.jsonl", encoding="utf-8") as stream:
    assert sum(1 for _ in stream) == CANARIES


def test_dp_seqrec_stays_below_its_claim(sequences_dir):
  summary = seqrec.audit_seqrec(_options(sequences_dir, EPSILON), canaries=CANARIES)
  assert summary["claimed_epsilon"] == EPSILON and summary["noise_multiplier"] > 0
  assert 0.0 <= summary["epsilon_lower_bound"] <= EPSILON
