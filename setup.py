"""Installs dprec: sparse-gradient differentially private training for embedding models."""
from setuptools import find_packages, setup

REQUIRES = [
    "tensorflow==2.15.1",
    "tf-keras==2.15.1",
    "tensorflow-privacy==0.9.0",
    "tensorflow-recommenders==0.7.7",
    "dp-accounting==0.4.3",
    "apache-beam==2.77.0",
    "numpy==1.26.4",
    "scipy",
    "pandas",
    "pyarrow",
    "tqdm",
    "matplotlib",
]

setup(
    name="dprec",
    version="0.1.0",
    description="Differentially private training for large-embedding recommender models",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["dprec", "dprec.*", "pipelines", "pipelines.*"]),
    install_requires=REQUIRES,
    extras_require={
        "test": ["pytest", "pytest-xdist", "nbformat", "nbclient", "ipykernel"],
        "notebooks": ["jupyter", "nbformat", "nbclient", "ipykernel"],
    },
    entry_points={"console_scripts": ["dprec = dprec.cli:main"]},
)
