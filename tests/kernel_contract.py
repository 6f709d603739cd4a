"""The contract every Pallas kernel of kernels_pallas/ keeps, written once: a test file gives a kernel's hooks to a
subclass named Test* and pytest runs these tests for it.

    class TestWindowedContract(KernelContract):
        CUSTOM_CALL = "windowed_draft_attention"
        def f32_cases(self): ...          # and the other hooks below

The contract:
  * run in interpret mode (interpret=True, on this CPU), the kernel matches its pure-JAX reference: tightly in
    f32 (test_f32_matches_reference), at the output's rounding in bf16 / f16, and with bf16 or fp8 inputs
    (test_low_precision_matches_reference); every case is one the kernel says it takes (no reason);
  * a shape the kernel does not take falls back to the reference with a stated reason and a warning naming it,
    once per process (test_unsupported_shape_falls_back_with_reason);
  * the dispatching function (backend "auto") runs the reference on this CPU; the program lowered for cpu (and
    rocm) holds no Pallas kernel, the one lowered for cuda holds the kernel's custom call
    (test_backend_follows_the_lowering_platform).

A case is whatever the kernel's test file uses to describe one (a tuple, a dataclass): the contract passes it
back to the hooks and never looks inside. Tolerances are tuples compared with the error tuple of `error`
element by element: a case passes when any element is within its bound (e.g. max_rel < 1e-5 or max_abs < 1e-6).
`check_more` holds the kernel's own checks of the same run (an independent oracle, the plan it took, a report
line), so that each case compiles once.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from kernels_pallas import dispatch
from qwen_mtp.tools.lowering import export_for, kernel_calls


class KernelContract:
    """Base of a kernel's contract tests (not collected itself: its name does not start with Test)."""

    # ------------------------------------------------------------------------------------------ the hooks
    def f32_cases(self) -> list:
        """Cases in f32 (inputs and output), checked against F32_TOL."""
        raise NotImplementedError

    def low_precision_cases(self) -> list:
        """Cases with bf16 / f16 / fp8 inputs, checked against tolerance(case)."""
        raise NotImplementedError

    def case_id(self, case) -> str:
        return str(case)

    def inputs(self, case) -> tuple:
        """The positional arrays of the kernel, of its reference and of the dispatching function."""
        raise NotImplementedError

    def kernel(self, case, *args):
        """The Pallas kernel in interpret mode (directly, or through the dispatch with backend="pallas")."""
        raise NotImplementedError

    def reference(self, case, *args):
        raise NotImplementedError

    def dispatching(self, case, *args, **kw):
        """The public function that chooses kernel or reference (kw: backend, interpret)."""
        raise NotImplementedError

    def reason(self, case, *args):
        """The kernel's unsupported_reason for these inputs (None: it takes them)."""
        raise NotImplementedError

    def error(self, got, want) -> tuple:
        """The error measures (e.g. (max_rel, max_abs)) that F32_TOL and tolerance() bound."""
        raise NotImplementedError

    F32_TOL: tuple = ()

    def tolerance(self, case) -> tuple:
        raise NotImplementedError

    def check_more(self, case, args, got, ref, report) -> None:
        """The kernel's own checks on one case's output (an oracle, the plan, the report line)."""

    def unsupported_case(self):
        """(case, the fragment its reason must contain): a shape the kernel does not take."""
        raise NotImplementedError

    def more_unsupported_reasons(self) -> list:
        """[(reason, fragment)]: further inputs the kernel refuses, with what their reason must say."""
        return []

    def check_fallback(self, case, args, out) -> None:
        """The kernel's own checks on the fallback's output."""

    FALLBACK_EXACT = True  # the fallback gives the reference's bits (False: equal to within float rounding)

    def lowering_case(self):
        raise NotImplementedError

    def auto(self, case):
        """The dispatching function with backend "auto", as a callable of the inputs (jitted or not)."""
        raise NotImplementedError

    def custom_call(self, case) -> str:
        """The kernel's custom call name in a program lowered for cuda."""
        raise NotImplementedError

    def out_dtype(self, case, args):
        """The kernel output's dtype: x's (the first input's), unless a kernel says otherwise."""
        return args[0].dtype

    def custom_calls(self, case) -> list:
        """Every custom call a program lowered for cuda holds, in order (a kernel of two launches names both)."""
        return [self.custom_call(case)]

    # ----------------------------------------------------------------------------------- parametrisation
    def pytest_generate_tests(self, metafunc):
        for arg, hook in (("f32_case", self.f32_cases), ("low_case", self.low_precision_cases)):
            if arg in metafunc.fixturenames:
                cases = hook()
                metafunc.parametrize(arg, cases, ids=[self.case_id(c) for c in cases])

    # --------------------------------------------------------------------------------------- the contract
    def _matches(self, case, tol, report):
        args = self.inputs(case)
        assert self.reason(case, *args) is None, self.reason(case, *args)
        got = self.kernel(case, *args)
        ref = self.reference(case, *args)
        assert got.dtype == self.out_dtype(case, args) and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
        err = self.error(got, ref)
        assert any(e < t for e, t in zip(err, tol)), (err, tol)
        self.check_more(case, args, got, ref, report)

    def test_f32_matches_reference(self, f32_case, report):
        assert self.inputs(f32_case)[0].dtype == np.float32
        self._matches(f32_case, self.F32_TOL, report)

    def test_low_precision_matches_reference(self, low_case, report):
        self._matches(low_case, self.tolerance(low_case), report)

    def test_unsupported_shape_falls_back_with_reason(self, monkeypatch):
        monkeypatch.setattr(dispatch, "_warned", set())  # the warning is once per process: start afresh
        case, fragment = self.unsupported_case()
        args = self.inputs(case)
        reason = self.reason(case, *args)
        assert reason is not None and fragment in reason, (reason, fragment)
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            out = self.dispatching(case, *args, backend="pallas", interpret=True)
        assert any(issubclass(w.category, UserWarning) and fragment in str(w.message) for w in first), first
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            self.dispatching(case, *args, backend="pallas", interpret=True)
        assert not [w for w in second if fragment in str(w.message)], "the fallback warned twice"
        ref = self.reference(case, *args)
        if self.FALLBACK_EXACT:
            np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        else:
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref))
        self.check_fallback(case, args, out)
        for reason, fragment in self.more_unsupported_reasons():
            assert reason is not None and fragment in reason, (reason, fragment)

    def test_backend_follows_the_lowering_platform(self):
        """backend "auto" on this CPU: the reference's numbers; lowered for cpu or rocm, no Pallas kernel in the
        program; lowered for cuda (on this CPU: jax.export runs the GPU lowering), the kernel's custom call."""
        assert jax.default_backend() == "cpu"
        case = self.lowering_case()
        args = self.inputs(case)
        fn = self.auto(case)
        np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(self.reference(case, *args)))
        for platform in ("cpu", "rocm"):
            assert kernel_calls(export_for(fn, *args, platform=platform)) == [], platform
        assert kernel_calls(export_for(fn, *args, platform="cuda")) == self.custom_calls(case)


def compiles_for_sm90(cases, custom_call: str, what: str, report) -> None:
    """The sm_90 half of a kernel's real-shape test, written once: each case (label, fn, abstract args) lowered
    for cuda holds exactly the kernel's custom call, lowered for cpu none, and its Triton IR compiles to sm_90
    machine code within a block's shared memory and with no register spilled (one report line a case)."""
    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90, triton_kernels
    from tests.test_export_cuda import require_triton

    kernels = []
    for label, fn, args in cases:
        exported = export_for(fn, *args)
        assert kernel_calls(exported) == [custom_call], (label, kernel_calls(exported))
        assert kernel_calls(export_for(fn, *args, platform="cpu")) == [], label
        (kernel,) = triton_kernels(exported)
        kernels.append(kernel)
    require_triton()
    for (label, _, _), kernel, r in zip(cases, kernels, compile_sm90(kernels)):
        assert r["error"] is None, (label, r["error"])
        report(f"sm_90 compile, {what} {label}: grid {kernel.grid}, {kernel.num_warps} warps, shared "
               f"{r['shared']} B, {r['registers']} registers, {r['stack']} B spilled")
        assert r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0, (label, r)
