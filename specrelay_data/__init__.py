"""The evaluation prompt sets read from their data-only packages (HumanEval, MT-Bench),
shared by the benchmark, the draft distiller, the speed probe and the exit-head fit.
Below every room that reads them: nothing here imports bench, exporters or cloud_api."""
