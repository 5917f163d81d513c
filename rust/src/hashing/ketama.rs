//! libketama's hashes: the 32-bit key hash and the continuum points of a server.
//!
//! Invariants (libketama, last.fm, and `uhashring`'s ketama mode):
//! - [`ketama_hash`] of a key is the first four bytes of its MD5 digest read little-endian
//!   (`ketama_hashi`). Integer keys are hashed as their decimal text, as `uhashring` does
//!   (`md5(str(key))`).
//! - [`ketama_points`] of server `name` and digest index `j` are the four little-endian 32-bit
//!   words of `MD5("{name}-{j}")`.
//! - [`ketama_hash_many`] (and [`KetamaLanes`], fed one key at a time) returns exactly
//!   [`ketama_hash`] for every key, in order. Keys of at most
//!   55 bytes (one MD5 block) are hashed [`LANES`] at a time in SIMD lanes (AVX-512 or AVX2 when the
//!   CPU has it, SSE2/NEON otherwise), written straight into the lanes' transposed message words
//!   (no per-key block to transpose); longer keys take the scalar MD5 path.
//! - A single one-block key is hashed in general registers, or in one AVX-512 128-bit vector
//!   where the CPU has it (a shorter dependency chain: `md5_word0_xmm`); both are tested
//!   against the `md-5` crate on every length.

use md5::{Digest, Md5};

use super::Key;

/// Longest message that fits in one padded MD5 block.
const ONE_BLOCK: usize = 55;
/// Keys hashed together by the multi-lane MD5: on x86-64, 48 (three AVX2 or AVX-512 vectors, four
/// groups of three SSE2 ones); elsewhere 32 (NEON: four groups of two 4-lane vectors, as measured
/// before the x86-64 change; not measured since).
#[cfg(target_arch = "x86_64")]
pub(super) const LANES: usize = 48;
/// Keys hashed together by the multi-lane MD5 (see the x86-64 value).
#[cfg(not(target_arch = "x86_64"))]
pub(super) const LANES: usize = 32;
/// Lanes per group without AVX2 (SSE2 or NEON, 4 per vector). On x86-64, with 48 lanes, groups of
/// 8 compiled to scalar code (LLVM did not vectorize six groups unrolled into one function: 68 ns
/// per key in a Rust loop); 12 vectorize (44 ns; 41 ns for 32 lanes in groups of 8 before).
#[cfg(target_arch = "x86_64")]
pub(super) const BASE_GROUP: usize = 12;
/// Lanes per group without AVX2 (see the x86-64 value).
#[cfg(not(target_arch = "x86_64"))]
pub(super) const BASE_GROUP: usize = 8;

const INIT: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];

/// MD5 round constants, `floor(abs(sin(i + 1)) * 2^32)` (RFC 1321).
const K: [u32; 64] = [
    0xd76a_a478,
    0xe8c7_b756,
    0x2420_70db,
    0xc1bd_ceee,
    0xf57c_0faf,
    0x4787_c62a,
    0xa830_4613,
    0xfd46_9501,
    0x6980_98d8,
    0x8b44_f7af,
    0xffff_5bb1,
    0x895c_d7be,
    0x6b90_1122,
    0xfd98_7193,
    0xa679_438e,
    0x49b4_0821,
    0xf61e_2562,
    0xc040_b340,
    0x265e_5a51,
    0xe9b6_c7aa,
    0xd62f_105d,
    0x0244_1453,
    0xd8a1_e681,
    0xe7d3_fbc8,
    0x21e1_cde6,
    0xc337_07d6,
    0xf4d5_0d87,
    0x455a_14ed,
    0xa9e3_e905,
    0xfcef_a3f8,
    0x676f_02d9,
    0x8d2a_4c8a,
    0xfffa_3942,
    0x8771_f681,
    0x6d9d_6122,
    0xfde5_380c,
    0xa4be_ea44,
    0x4bde_cfa9,
    0xf6bb_4b60,
    0xbebf_bc70,
    0x289b_7ec6,
    0xeaa1_27fa,
    0xd4ef_3085,
    0x0488_1d05,
    0xd9d4_d039,
    0xe6db_99e5,
    0x1fa2_7cf8,
    0xc4ac_5665,
    0xf429_2244,
    0x432a_ff97,
    0xab94_23a7,
    0xfc93_a039,
    0x655b_59c3,
    0x8f0c_cc92,
    0xffef_f47d,
    0x8584_5dd1,
    0x6fa8_7e4f,
    0xfe2c_e6e0,
    0xa301_4314,
    0x4e08_11a1,
    0xf753_7e82,
    0xbd3a_f235,
    0x2ad7_d2bb,
    0xeb86_d391,
];

/// Message words of up to `L` single-block messages, transposed (`m[word][lane]`).
pub(super) type Block<const L: usize> = [[u32; L]; 16];

/// The message-word variants compiled for the AVX-512 and AVX2 lanes: `W` such that every word at index
/// `W..14` (and word 15) is zero in every lane, so its additions are left out. A key of `n` bytes
/// uses words `0..=n / 4` (the last holds the 0x80 terminator) and word 14 (its bit length).
/// The last is 14: every one-block key.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const WORD_VARIANTS: [usize; 4] = [4, 6, 8, 14];

/// `v`, as a value the optimiser cannot see into, when `L == 1` (the scalar MD5): it then keeps
/// the sums built before a step's chain-dependent operand is added, instead of reassociating them
/// onto the chain (which made each step two to three additions longer). Generates no
/// instruction (elsewhere than x86-64 and AArch64, it is `v` as is). Lanes (`L > 1`) are left to
/// the optimiser.
#[inline(always)]
fn settled<const L: usize>(v: u32) -> u32 {
    let mut v = v;
    if L == 1 {
        // SAFETY: an empty template (a comment naming the register): no instruction, and no
        // memory, stack or flags touched.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("/* {0:e} */", inout(reg) v, options(pure, nomem, nostack, preserves_flags));
        }
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        unsafe {
            std::arch::asm!("/* {0:w} */", inout(reg) v, options(pure, nomem, nostack, preserves_flags));
        }
    }
    v
}

/// `t + F(x, y, z)`; `t` and the terms of `y` and `z` are ready before `x` (the previous step's
/// result). F = z ^ (x & (y ^ z)): two operations after `x`.
#[inline(always)]
fn f<const L: usize>(t: u32, x: u32, y: u32, z: u32) -> u32 {
    settled::<L>(t).wrapping_add(z ^ (x & settled::<L>(y ^ z)))
}

/// `t + G(x, y, z)`, G = (x & z) | (y & !z), whose two terms share no bit: so `t + (y & !z)` is
/// summed ahead, and one operation (`x & z`) and one add follow `x`.
#[inline(always)]
fn g<const L: usize>(t: u32, x: u32, y: u32, z: u32) -> u32 {
    if L == 1 {
        return settled::<L>(t.wrapping_add(y & !z)).wrapping_add(x & z);
    }
    t.wrapping_add((x & z) | (y & !z))
}

/// `t + H(x, y, z)`, H = x ^ y ^ z: `y ^ z` ahead, one operation after `x`.
#[inline(always)]
fn h<const L: usize>(t: u32, x: u32, y: u32, z: u32) -> u32 {
    settled::<L>(t).wrapping_add(x ^ settled::<L>(y ^ z))
}

/// `t + I(x, y, z)`, I = y ^ (x | !z): `!z` ahead, two operations after `x`.
#[inline(always)]
fn i<const L: usize>(t: u32, x: u32, y: u32, z: u32) -> u32 {
    settled::<L>(t).wrapping_add(y ^ (x | settled::<L>(!z)))
}

/// The 61 steps of MD5 that feed digest word 0 (RFC 1321's message word and rotation for each),
/// as calls of the caller's `$step!(round, a, b, c, d, step, word, rotation)`, with `$f $g $h $i`
/// standing for the four round functions and `$a $b $c $d` for the caller's state.
macro_rules! md5_word0_schedule {
    ($step:ident, [$f:tt, $g:tt, $h:tt, $i:tt], $a:ident, $b:ident, $c:ident, $d:ident) => {
        md5_word0_schedule!(@four $step, $f, 0, [0, 1, 2, 3], [7, 12, 17, 22], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $f, 4, [4, 5, 6, 7], [7, 12, 17, 22], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $f, 8, [8, 9, 10, 11], [7, 12, 17, 22], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $f, 12, [12, 13, 14, 15], [7, 12, 17, 22], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $g, 16, [1, 6, 11, 0], [5, 9, 14, 20], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $g, 20, [5, 10, 15, 4], [5, 9, 14, 20], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $g, 24, [9, 14, 3, 8], [5, 9, 14, 20], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $g, 28, [13, 2, 7, 12], [5, 9, 14, 20], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $h, 32, [5, 8, 11, 14], [4, 11, 16, 23], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $h, 36, [1, 4, 7, 10], [4, 11, 16, 23], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $h, 40, [13, 0, 3, 6], [4, 11, 16, 23], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $h, 44, [9, 12, 15, 2], [4, 11, 16, 23], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $i, 48, [0, 7, 14, 5], [6, 10, 15, 21], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $i, 52, [12, 3, 10, 1], [6, 10, 15, 21], $a, $b, $c, $d);
        md5_word0_schedule!(@four $step, $i, 56, [8, 15, 6, 13], [6, 10, 15, 21], $a, $b, $c, $d);
        $step!($i, $a, $b, $c, $d, 60, 4, 6);
    };
    (@four $step:ident, $r:tt, $n:expr, [$g0:tt, $g1:tt, $g2:tt, $g3:tt], [$s0:tt, $s1:tt, $s2:tt, $s3:tt], $a:ident, $b:ident, $c:ident, $d:ident) => {
        $step!($r, $a, $b, $c, $d, $n, $g0, $s0);
        $step!($r, $d, $a, $b, $c, $n + 1, $g1, $s1);
        $step!($r, $c, $d, $a, $b, $n + 2, $g2, $s2);
        $step!($r, $b, $c, $d, $a, $n + 3, $g3, $s3);
    };
}

/// Word 0 of the MD5 digest (the first four digest bytes, little-endian) of each lane's block.
///
/// `rows[w]` holds message word `w` of every lane; words `W..14` and 15 must be zero in every lane
/// (their additions are skipped). Only the 61 steps that feed word 0 run: the last three steps
/// update the other words.
#[inline(always)]
fn md5_word0<const L: usize, const W: usize>(rows: [&[u32; L]; 16]) -> [u32; L] {
    let [a0, b0, c0, d0] = INIT;
    let (mut a, mut b, mut c, mut d) = ([a0; L], [b0; L], [c0; L], [d0; L]);
    macro_rules! step {
        ($r:ident, $a:ident, $b:ident, $c:ident, $d:ident, $i:expr, $g:expr, $s:expr) => {
            let m = rows[$g];
            for l in 0..L {
                // `a + K + M` does not depend on `b`: it is summed first, and `t + f(b, c, d)`
                // keeps one add on the step-to-step dependency chain. A word known to be zero
                // is not added.
                let mut t = $a[l].wrapping_add(K[$i]);
                if $g < W || $g == 14 {
                    t = t.wrapping_add(m[l]);
                }
                let t = $r::<L>(t, $b[l], $c[l], $d[l]);
                $a[l] = $b[l].wrapping_add(t.rotate_left($s));
            }
        };
    }
    md5_word0_schedule!(step, [f, g, h, i], a, b, c, d);
    for x in a.iter_mut() {
        *x = x.wrapping_add(a0);
    }
    a
}

/// Runs [`md5_word0`] on the `L` lanes of `m`, `G` lanes at a time (`G` divides `L`): enough
/// independent lanes to hide one MD5 step's latency, few enough that the state stays in
/// registers. Words `W..14` and 15 must be zero in every lane.
#[inline(always)]
pub(super) fn md5_word0_by<const L: usize, const G: usize, const W: usize>(
    m: &Block<L>,
) -> [u32; L] {
    const { assert!(G > 0 && L.is_multiple_of(G), "G must divide L") };
    let zero = [0; G];
    let mut out = [0; L];
    for (o, dest) in out.chunks_exact_mut(G).enumerate() {
        let at = o * G..o * G + G;
        // Every row has `L` lanes and `G` divides `L`, so `zero` is never used.
        let rows: [&[u32; G]; 16] = std::array::from_fn(|w| {
            m.get(w)
                .and_then(|r| r.get(at.clone()))
                .and_then(|r| r.try_into().ok())
                .unwrap_or(&zero)
        });
        dest.copy_from_slice(&md5_word0::<G, W>(rows));
    }
    out
}
/// [`md5_word0`] of the [`LANES`] lanes of `m`, whose words `used..14` and 15 are zero in every
/// lane, on the widest vectors the CPU has.
fn md5_word0_lanes(m: &Block<LANES>, used: usize) -> [u32; LANES] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the running CPU supports AVX-512F and VL (checked just above).
            return unsafe { md5_word0_lanes_avx512(m, used) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the running CPU supports AVX2 (checked just above).
            return unsafe { md5_word0_lanes_avx2(m, used) };
        }
    }
    // SSE2 (x86-64's baseline) or NEON: 4 lanes per vector (see `BASE_GROUP`).
    md5_word0_by::<LANES, BASE_GROUP, 14>(m)
}

/// The same computation compiled for AVX-512: a rotate is one instruction (`vprold`), the round
/// functions one `vpternlogd`, and three 16-lane vectors are interleaved. Compiled once per
/// [`WORD_VARIANTS`] entry, so the additions of words that are zero in every lane are left out.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
pub(super) fn md5_word0_lanes_avx512(m: &Block<LANES>, used: usize) -> [u32; LANES] {
    const V: [usize; 4] = WORD_VARIANTS;
    match used {
        u if u <= V[0] => md5_word0_by::<LANES, LANES, { V[0] }>(m),
        u if u <= V[1] => md5_word0_by::<LANES, LANES, { V[1] }>(m),
        u if u <= V[2] => md5_word0_by::<LANES, LANES, { V[2] }>(m),
        _ => md5_word0_by::<LANES, LANES, { V[3] }>(m),
    }
}

/// The same computation compiled for AVX2: three 8-lane vectors interleaved, enough to keep the
/// vector units busy through a step's dependency chain (two left them waiting: 16.4-17.0 ns per
/// key for `ketama_hash_many` over 100k short keys in a Rust loop vs 14.0-14.2 with three, AMD
/// EPYC Zen 3; four spill registers, 20.6-20.9). Compiled once per [`WORD_VARIANTS`] entry, as
/// for AVX-512: 13.4-13.5 ns (with two vectors, LLVM left the variants below 14 scalar: 64 ns).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) fn md5_word0_lanes_avx2(m: &Block<LANES>, used: usize) -> [u32; LANES] {
    const V: [usize; 4] = WORD_VARIANTS;
    match used {
        u if u <= V[0] => avx2_words::<{ V[0] }>(m),
        u if u <= V[1] => avx2_words::<{ V[1] }>(m),
        u if u <= V[2] => avx2_words::<{ V[2] }>(m),
        _ => avx2_words::<{ V[3] }>(m),
    }
}

/// [`md5_word0_lanes_avx2`] for words `W..14` and 15 zero in every lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
fn avx2_words<const W: usize>(m: &Block<LANES>) -> [u32; LANES] {
    md5_word0_by::<LANES, 24, W>(m)
}

/// [`md5_word0`] of one block in AVX-512's 128-bit vectors (lane 0): each step's round function
/// is one `vpternlogd` after the previous step, where the scalar F and I take two operations
/// (`x86_64` has no three-input logic on general registers), so every step is four operations
/// long on the chain: 244 cycles for the 61 steps, against 273 in general registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
pub(super) fn md5_word0_xmm(m: &Block<1>) -> u32 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi32, _mm_cvtsi128_si32, _mm_cvtsi32_si128, _mm_rol_epi32,
        _mm_ternarylogic_epi32,
    };
    /// `v` as a value the optimiser cannot see into (see [`settled`]): `a + K + M`, summed off
    /// the chain, stays a sum of its own.
    #[inline(always)]
    fn settled(v: __m128i) -> __m128i {
        let mut v = v;
        // SAFETY: an empty template (a comment naming the register): no instruction, and no
        // memory, stack or flags touched.
        unsafe {
            std::arch::asm!("/* {0} */", inout(xmm_reg) v, options(pure, nomem, nostack, preserves_flags));
        }
        v
    }
    let lane = |x: u32| _mm_cvtsi32_si128(x as i32);
    let word = |w: usize| m.get(w).map_or(0, |row| row[0]);
    let [a0, b0, c0, d0] = INIT;
    let (mut a, mut b, mut c, mut d) = (lane(a0), lane(b0), lane(c0), lane(d0));
    // The round functions as `vpternlogd` truth tables over (x, y, z): F = x ? y : z,
    // G = z ? x : y, H = x ^ y ^ z, I = y ^ (x | !z).
    macro_rules! step {
        ($imm:literal, $a:ident, $b:ident, $c:ident, $d:ident, $i:expr, $g:expr, $s:literal) => {
            let t = settled(_mm_add_epi32($a, lane(K[$i].wrapping_add(word($g)))));
            let f = _mm_ternarylogic_epi32::<$imm>($b, $c, $d);
            $a = _mm_add_epi32($b, _mm_rol_epi32::<$s>(_mm_add_epi32(t, f)));
        };
    }
    md5_word0_schedule!(step, [0xca, 0xe4, 0x96, 0x39], a, b, c, d);
    (_mm_cvtsi128_si32(a) as u32).wrapping_add(a0)
}

/// Writes the padded single MD5 block of `msg` (at most [`ONE_BLOCK`] bytes) into lane `lane` of
/// `m`, whose words `msg.len() / 4 + 1..14` and 15 must be zero in that lane: the message's
/// words, the 0x80 terminator, and the length in bits (word 14; word 15 stays zero). Returns the
/// number of leading words written, `msg.len() / 4 + 1`.
#[inline(always)]
pub(super) fn pad_lane<const L: usize>(m: &mut Block<L>, lane: usize, msg: &[u8]) -> usize {
    let msg = msg.get(..ONE_BLOCK).unwrap_or(msg);
    let mut words = msg.chunks_exact(4);
    let mut rows = m.iter_mut();
    // `words` first: `zip` stops on it without taking the terminator's row.
    for (word, row) in (&mut words).zip(&mut rows) {
        if let (Some(slot), Ok(bytes)) = (row.get_mut(lane), <[u8; 4]>::try_from(word)) {
            *slot = u32::from_le_bytes(bytes);
        }
    }
    // The last word is assembled in a register: built in memory byte by byte and read back as
    // a word, it would stall on store forwarding once per key.
    let tail = words.remainder();
    let last = tail
        .iter()
        .rev()
        .fold(0x80u32, |word, &byte| (word << 8) | u32::from(byte));
    if let Some(slot) = rows.next().and_then(|row| row.get_mut(lane)) {
        *slot = last;
    }
    if let Some(slot) = m.get_mut(14).and_then(|row| row.get_mut(lane)) {
        *slot = (msg.len() * 8) as u32;
    }
    msg.len() / 4 + 1
}

/// Decimal text of `value` in `buf`; returns the used tail.
fn decimal(value: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut v = value;
    let mut at = buf.len();
    loop {
        at -= 1;
        if let Some(d) = buf.get_mut(at) {
            *d = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 || at == 0 {
            break;
        }
    }
    buf.get(at..).unwrap_or_default()
}

fn scalar_word0(msg: &[u8]) -> u32 {
    if msg.len() <= ONE_BLOCK {
        let mut m: Block<1> = [[0]; 16];
        pad_lane(&mut m, 0, msg);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the running CPU supports AVX-512F and VL (checked just above).
            return unsafe { md5_word0_xmm(&m) };
        }
        return md5_word0_by::<1, 1, 14>(&m)[0];
    }
    let digest = Md5::digest(msg);
    u32::from_le_bytes([digest[0], digest[1], digest[2], digest[3]])
}

/// libketama's `ketama_hashi` of a key (see the module invariants for integer keys).
pub fn ketama_hash(key: Key<'_>) -> u32 {
    match key {
        Key::Bytes(b) => scalar_word0(b),
        Key::Int(k) => scalar_word0(decimal(k, &mut [0; 20])),
    }
}

/// [`ketama_hash`] of every key, in order, passed to `sink`.
pub fn ketama_hash_many<'k>(keys: impl IntoIterator<Item = Key<'k>>, mut sink: impl FnMut(u32)) {
    let mut lanes = KetamaLanes::new();
    for key in keys {
        lanes.push(key, &mut sink);
    }
    lanes.flush(&mut sink);
}

/// [`ketama_hash`] of keys given one at a time: each key is padded into the MD5 lanes as it
/// comes (its bytes are read once, there and then), and every [`LANES`] keys the group is hashed
/// and its hashes passed to the sink, in order. [`KetamaLanes::flush`] hashes a partial group.
/// The sink thus sees the hash of key `i` once key `i + LANES - 1` is pushed, or at the flush.
pub struct KetamaLanes {
    m: Block<LANES>,
    /// Leading words written in some lane of the current group (see `pad_lane`).
    used: usize,
    /// Per position in the current group: a hash computed on the scalar path (long keys).
    scalar: [Option<u32>; LANES],
    /// Keys in the current group.
    filled: usize,
}

impl Default for KetamaLanes {
    fn default() -> Self {
        Self::new()
    }
}

impl KetamaLanes {
    /// No key pending.
    pub fn new() -> Self {
        Self {
            m: [[0; LANES]; 16],
            used: 0,
            scalar: [None; LANES],
            filled: 0,
        }
    }

    /// Adds a key; when it completes a group of [`LANES`], the group's hashes go to `sink`.
    #[inline(always)]
    pub fn push(&mut self, key: Key<'_>, sink: &mut impl FnMut(u32)) {
        let mut digits = [0u8; 20];
        let msg = match key {
            Key::Bytes(b) => b,
            Key::Int(k) => decimal(k, &mut digits),
        };
        let long = (msg.len() > ONE_BLOCK).then(|| scalar_word0(msg));
        if long.is_none() {
            self.used = self.used.max(pad_lane(&mut self.m, self.filled, msg));
        }
        if let Some(slot) = self.scalar.get_mut(self.filled) {
            *slot = long;
        }
        self.filled += 1;
        if self.filled == LANES {
            self.flush(sink);
        }
    }

    /// Hashes the keys pending (fewer than [`LANES`]) and passes their hashes to `sink`.
    pub fn flush(&mut self, sink: &mut impl FnMut(u32)) {
        if self.filled == 0 {
            return;
        }
        let lanes = md5_word0_lanes(&self.m, self.used);
        for (done, lane) in self.scalar.iter().zip(lanes).take(self.filled) {
            sink(done.unwrap_or(lane));
        }
        // Back to all-zero words for the next group (word 14 is rewritten in every lane).
        for row in self.m.iter_mut().take(self.used) {
            *row = [0; LANES];
        }
        (self.filled, self.used) = (0, 0);
    }
}

/// The four continuum points libketama derives from `MD5("{name}-{j}")`.
pub fn ketama_points(name: &str, j: u64) -> [u32; 4] {
    let mut hasher = Md5::new();
    hasher.update(name.as_bytes());
    hasher.update(b"-");
    hasher.update(decimal(j, &mut [0; 20]));
    let d = hasher.finalize();
    [
        u32::from_le_bytes([d[0], d[1], d[2], d[3]]),
        u32::from_le_bytes([d[4], d[5], d[6], d[7]]),
        u32::from_le_bytes([d[8], d[9], d[10], d[11]]),
        u32::from_le_bytes([d[12], d[13], d[14], d[15]]),
    ]
}
