//! Build script: with the `python` feature, PyO3's cfgs for the binding layer (`Py_3_*`,
//! `Py_LIMITED_API` for an abi3 build, `Py_GIL_DISABLED`, `PyPy`, `GraalPy`), as PyO3 sets them
//! for itself, so that rust/src/py can read CPython objects in place where the ABI allows it.

fn main() {
    // The names are declared even without Python, so that `cfg(...)` on them is never unknown.
    for name in [
        "Py_LIMITED_API",
        "Py_GIL_DISABLED",
        "PyPy",
        "GraalPy",
        "RustPython",
    ] {
        println!("cargo:rustc-check-cfg=cfg({name})");
    }
    for minor in 7..=16 {
        println!("cargo:rustc-check-cfg=cfg(Py_3_{minor})");
    }
    println!(
        r#"cargo:rustc-check-cfg=cfg(py_sys_config, values("Py_DEBUG", "Py_REF_DEBUG", "Py_TRACE_REFS", "COUNT_ALLOCS"))"#
    );
    println!("cargo:rustc-check-cfg=cfg(cpython_in_place)");
    #[cfg(feature = "python")]
    python_cfgs();
}

/// PyO3's cfgs, plus `cpython_in_place` where rust/src/py/in_place.rs may read objects in place:
/// CPython with the GIL, version-specific (not abi3), before 3.14 (whose `str` header PyO3 does
/// not describe).
#[cfg(feature = "python")]
fn python_cfgs() {
    let cfgs = pyo3_build_config::get().build_script_outputs();
    for cfg in &cfgs {
        println!("{cfg}");
    }
    let set = |name: &str| cfgs.iter().any(|c| c == &format!("cargo:rustc-cfg={name}"));
    let other = [
        "Py_LIMITED_API",
        "Py_GIL_DISABLED",
        "PyPy",
        "GraalPy",
        "RustPython",
        "Py_3_14",
    ];
    if !other.iter().any(|name| set(name)) {
        println!("cargo:rustc-cfg=cpython_in_place");
    }
}
