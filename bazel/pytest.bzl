"""`pytest_test`: a py_test whose main runs pytest on its sources (our tests are pytest modules:
run as plain scripts they would define their tests and pass without running one)."""

def pytest_test(name, srcs, deps = [], data = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//bazel:pytest_main.py"],
        main = "//bazel:pytest_main.py",
        args = ["$(location %s)" % src for src in srcs],
        deps = deps,
        data = data + ["//:pytest_config"] + native.glob(["conftest.py"]),
        legacy_create_init = False,
        # Each test process imports TensorFlow first: Bazel's 300 s default is tight on 2 cores.
        timeout = kwargs.pop("timeout", "long"),
        **kwargs
    )
