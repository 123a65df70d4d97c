"""Privacy accounting, noise calibration, DP top-k selection and the persistent ledger."""
from dprec.privacy.accounting import adafest_noise_multipliers
from dprec.privacy.accounting import composed_noise_multiplier
from dprec.privacy.accounting import compute_epsilon
from dprec.privacy.accounting import dataset_sampling
from dprec.privacy.accounting import dp_sgd_event
from dprec.privacy.accounting import gaussian_epsilon
from dprec.privacy.accounting import make_accountant
from dprec.privacy.accounting import NOT_POISSON_NOTE
from dprec.privacy.accounting import PrivacyResult
from dprec.privacy.accounting import TrainingPeriod
from dprec.privacy.calibration import calibrate_noise_multiplier
from dprec.privacy.calibration import plan_training
from dprec.privacy.calibration import TrainingPlan
