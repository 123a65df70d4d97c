"""Empirical privacy auditing: canaries, scores, and ε lower bounds."""
from dprec.audit.bounds import best_bounds
from dprec.audit.bounds import epsilon_lower_bound
from dprec.audit.bounds import gdp_epsilon_lower_bound
from dprec.audit.bounds import guess_membership
from dprec.audit.bounds import one_run_p_value
