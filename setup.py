"""Installs dprec: sparse-gradient differentially private training for embedding models."""
from setuptools import find_packages, setup

# The current TensorFlow stack: Keras 2 through tf-keras (dprec sets TF_USE_LEGACY_KERAS=1).
# Lower bounds admit TF 2.15, so that the `tfp` extra below can select the stack on which our peer,
# tensorflow-privacy (last release 0.9.0, Feb. 2024, imports only on TF <= 2.15), runs; a plain
# install resolves the newest releases (TF 2.21, numpy 2, dp-accounting 0.6 today). No upper pins:
# none is needed by a measured failure.
REQUIRES = [
    "tensorflow>=2.15.1",
    "tf-keras>=2.15.1",
    "tensorflow-recommenders>=0.7.3",
    "dp-accounting>=0.4.3",
    "apache-beam>=2.60",
    "numpy>=1.26",
    "scipy",
    "mpmath",  # secure noise: 256-bit rates of exact geometric gaps
    "pandas",
    "pyarrow",
    "tqdm",
    "matplotlib",
    "tensorboard",
]
# The peer stack of the legacy CI leg (`pip install -e .[tfp,test]`): tensorflow-privacy's pins.
PEERS = [
    "tensorflow-privacy==0.9.0",
    "tensorflow==2.15.1",
    "tf-keras==2.15.1",
    "dp-accounting==0.4.3",
    "numpy<2",
]
# The API reference (docs/api): Sphinx's autodoc and napoleon; the `test` extra builds it too.
DOCS = ["sphinx>=7"]

setup(
    name="dprec",
    version="0.1.0",
    description="Differentially private training for large-embedding recommender models",
    python_requires=">=3.10",  # what TF 2.21 and Beam 2.77 support; CI tests 3.11
    packages=find_packages(include=["dprec", "dprec.*", "pipelines", "pipelines.*"]),
    install_requires=REQUIRES,
    extras_require={
        # apache-beam[dask]: Beam's DaskRunner, on which tests/pipelines/test_dask_runner.py
        # checks that the Beam jobs write the embedded runner's bytes (`--runner DaskRunner`).
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.5",  # --maxschedchunk (Makefile)
                 "ruff",  # `make lint`, run by `make test` (ruff.toml)
                 "nbformat", "nbclient", "ipykernel", *DOCS,
                 "apache-beam[dask]"],
        # KerasRS (Keras 3 only) for tests/dp_core/test_keras_rs.py: the default leg installs it
        # (Makefile); not in `test`, which the legacy leg's Keras 2 would also install it beside.
        "kerasrs": ["keras-rs>=0.4.0"],
        "docs": DOCS,
        "dask": ["apache-beam[dask]"],
        "notebooks": ["jupyter", "nbformat", "nbclient", "ipykernel"],
        "tfp": PEERS,
    },
    entry_points={"console_scripts": ["dprec = dprec.cli:main"]},
)
