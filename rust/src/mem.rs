//! Memory hints for hot paths: cache-line prefetches and transparent huge pages.
//!
//! Guarantee: these are only hints to the CPU and the kernel. They never fault, never change a
//! value the program reads, and compile to nothing where the platform has no such hint.

/// Hints the CPU to bring the cache line of `value` into cache (nothing for `None`).
#[inline(always)]
pub(crate) fn prefetch<T>(value: Option<&T>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = value {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE, which `_mm_prefetch` requires, is part of the x86-64 baseline; a prefetch
        // is only a hint: it never faults and reads nothing into the program.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(v).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// Hints the CPU to bring the cache line holding address `at` into cache. Any address will do:
/// a prefetch never faults, and `at` is never read. (Used where the binding layer reads Python
/// objects in place: rust/src/py/in_place.rs.)
#[cfg(cpython_in_place)]
#[inline(always)]
pub(crate) fn prefetch_addr(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: as in `prefetch`; the address is not dereferenced.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Asks Linux to back a large buffer with transparent huge pages (as NumPy does for its large
/// arrays): random probes into a table of many megabytes otherwise miss the TLB on nearly every
/// access. Buffers under 4 MiB are left alone.
pub(crate) fn advise_huge_pages<T>(buffer: &[T]) {
    #[cfg(target_os = "linux")]
    {
        const MADV_HUGEPAGE: i32 = 14;
        const PAGE: usize = 4096;
        const MIN_BYTES: usize = 4 << 20;
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        let start = buffer.as_ptr() as usize;
        let end = start + std::mem::size_of_val(buffer);
        let aligned = start.next_multiple_of(PAGE);
        if end.saturating_sub(aligned) >= MIN_BYTES {
            // SAFETY: the range lies inside `buffer`'s allocation, starts on a page boundary, and
            // MADV_HUGEPAGE does not change the memory's contents or validity.
            unsafe {
                madvise(
                    aligned as *mut std::ffi::c_void,
                    end - aligned,
                    MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}
