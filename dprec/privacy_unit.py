"""The names a row carries when ε protects a user rather than a row, shared by the user sampler
(`dprec.training.user_sampling`), the DP step's per-user clipping (`dprec.clipping.units`) and the
data a user-level run reads."""

# int [B] in a batch: each row's unit index 0..U−1, a unit's rows together, units increasing.
UNIT_KEY = "privacy_unit"
# int [N] in the data: each row's user id.
USER_KEY = "user_id"
# k, the most rows of a user a user-level step or release reads, unless a run sets it: a fixed,
# public constant (`dprec.training.user_sampling`: why k is never read off the data).
DEFAULT_MAX_ROWS_PER_USER = 16
# What ε protects: a row, or a user (all rows with one user id).
PRIVACY_UNITS = ("row", "user")
