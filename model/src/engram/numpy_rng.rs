//! NumPy-compatible random integers for the Engram hash multipliers: `SeedSequence` entropy
//! mixing, the PCG64 bit generator (XSL-RR output) and `Generator.integers(low, high,
//! dtype=int64)` with NumPy's Lemire bounded-integer method. Written from NumPy's documented
//! algorithms so the multipliers can be derived for any config, not only the released one.

/// `SeedSequence` constants (NumPy `bit_generator.pyx`).
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
/// Entropy pool size in 32-bit words (NumPy's default `pool_size`).
const POOL_SIZE: usize = 4;

/// PCG's default 128-bit LCG multiplier.
const PCG_MULTIPLIER: u128 =
    (2_549_297_995_355_413_924_u128 << 64) | 4_865_540_595_714_422_341_u128;

/// NumPy's `SeedSequence` for an integer seed without spawn key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

/// The running hash constant of one `hashmix` chain.
struct HashChain(u32);

impl HashChain {
    fn mix(&mut self, value: u32) -> u32 {
        let mut value = value ^ self.0;
        self.0 = self.0.wrapping_mul(MULT_A);
        value = value.wrapping_mul(self.0);
        value ^ (value >> XSHIFT)
    }
}

fn mix(x: u32, y: u32) -> u32 {
    let result = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    result ^ (result >> XSHIFT)
}

impl SeedSequence {
    /// Seeds from a non-negative integer, split into little-endian 32-bit words as NumPy does
    /// (0 gives the single word `[0]`).
    pub fn new(seed: u128) -> SeedSequence {
        let mut entropy = Vec::new();
        let mut rest = seed;
        loop {
            entropy.push(rest as u32);
            rest >>= 32;
            if rest == 0 {
                break;
            }
        }
        let mut pool = [0_u32; POOL_SIZE];
        let mut chain = HashChain(INIT_A);
        for (i, slot) in pool.iter_mut().enumerate() {
            *slot = chain.mix(entropy.get(i).copied().unwrap_or(0));
        }
        for src in 0..POOL_SIZE {
            for dst in 0..POOL_SIZE {
                if src != dst {
                    let hashed = chain.mix(pool[src]);
                    pool[dst] = mix(pool[dst], hashed);
                }
            }
        }
        for &word in entropy.iter().skip(POOL_SIZE) {
            for dst in 0..POOL_SIZE {
                let hashed = chain.mix(word);
                pool[dst] = mix(pool[dst], hashed);
            }
        }
        SeedSequence { pool }
    }

    /// The mixed entropy pool.
    pub fn pool(&self) -> [u32; POOL_SIZE] {
        self.pool
    }

    /// `generate_state(n_words, dtype=np.uint64)`: 2·n 32-bit words, paired little-endian.
    pub fn generate_state_u64(&self, n_words: usize) -> Vec<u64> {
        let mut hash_const = INIT_B;
        let words: Vec<u32> = (0..2 * n_words)
            .map(|i| {
                let mut value = self.pool[i % POOL_SIZE] ^ hash_const;
                hash_const = hash_const.wrapping_mul(MULT_B);
                value = value.wrapping_mul(hash_const);
                value ^ (value >> XSHIFT)
            })
            .collect();
        words
            .chunks_exact(2)
            .map(|pair| u64::from(pair[0]) | (u64::from(pair[1]) << 32))
            .collect()
    }
}

/// NumPy's PCG64 bit generator (128-bit LCG, XSL-RR 64-bit output), including its one-word
/// buffer for 32-bit draws.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    increment: u128,
    buffered_u32: Option<u32>,
}

impl Pcg64 {
    /// `PCG64(seed)`: a `SeedSequence` supplies 4 u64 words, the first two the initial state
    /// (high word first), the last two the stream.
    pub fn from_seed(seed: u128) -> Pcg64 {
        let words = SeedSequence::new(seed).generate_state_u64(4);
        let initial_state = (u128::from(words[0]) << 64) | u128::from(words[1]);
        let stream = (u128::from(words[2]) << 64) | u128::from(words[3]);
        Pcg64::from_state_and_stream(initial_state, stream)
    }

    /// PCG's `srandom`: state 0, step, add the initial state, step.
    pub fn from_state_and_stream(initial_state: u128, stream: u128) -> Pcg64 {
        let mut rng = Pcg64 {
            state: 0,
            increment: (stream << 1) | 1,
            buffered_u32: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(initial_state);
        rng.step();
        rng
    }

    /// The LCG state and increment, as NumPy's `bit_generator.state` reports them.
    pub fn state(&self) -> (u128, u128) {
        (self.state, self.increment)
    }

    fn step(&mut self) {
        self.state = self
            .state
            .wrapping_mul(PCG_MULTIPLIER)
            .wrapping_add(self.increment);
    }

    /// One raw 64-bit draw (`random_raw`).
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let rotation = (self.state >> 122) as u32;
        let folded = ((self.state >> 64) as u64) ^ (self.state as u64);
        folded.rotate_right(rotation)
    }

    /// One 32-bit draw: the low half of a 64-bit draw, the high half kept for the next call.
    pub fn next_u32(&mut self) -> u32 {
        if let Some(buffered) = self.buffered_u32.take() {
            return buffered;
        }
        let draw = self.next_u64();
        self.buffered_u32 = Some((draw >> 32) as u32);
        draw as u32
    }

    /// Lemire's nearly-divisionless method on `bits`-wide draws (`draw`: 32 or 64 bits, as
    /// NumPy picks them by the range), for a range `0..=max` with `max` below the draws' largest
    /// value.
    fn bounded_lemire(&mut self, max: u64, bits: u32, draw: impl Fn(&mut Self) -> u64) -> u64 {
        let word = u128::from(u64::MAX >> (64 - bits));
        let range = u128::from(max) + 1;
        let mut product = u128::from(draw(self)) * range;
        let mut leftover = product & word;
        if leftover < range {
            let threshold = (word - u128::from(max)) % range;
            while leftover < threshold {
                product = u128::from(draw(self)) * range;
                leftover = product & word;
            }
        }
        (product >> bits) as u64
    }

    /// `Generator.integers(low, high, size=count, dtype=np.int64)` (half-open `[low, high)`,
    /// the unmasked default). `None` when `high <= low`, where NumPy raises.
    pub fn integers_i64(&mut self, low: i64, high: i64, count: usize) -> Option<Vec<i64>> {
        if high <= low {
            return None;
        }
        // The inclusive span `high - 1 - low` always fits in u64.
        let max = (i128::from(high) - 1 - i128::from(low)) as u64;
        let draws = (0..count)
            .map(|_| {
                let offset = if max == 0 {
                    0
                } else if max <= u64::from(u32::MAX) {
                    if max == u64::from(u32::MAX) {
                        u64::from(self.next_u32())
                    } else {
                        self.bounded_lemire(max, 32, |rng| u64::from(rng.next_u32()))
                    }
                } else if max == u64::MAX {
                    self.next_u64()
                } else {
                    self.bounded_lemire(max, 64, Self::next_u64)
                };
                (i128::from(low) + i128::from(offset)) as i64
            })
            .collect();
        Some(draws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values printed by NumPy 2.4.6 for seed 10007.
    #[test]
    fn seed_sequence_pool_and_state_match_numpy() {
        let seq = SeedSequence::new(10007);
        assert_eq!(
            seq.pool(),
            [0xf1a1_018d, 0xa7c6_0c02, 0xfd15_d50a, 0x03b8_1232]
        );
        assert_eq!(
            seq.generate_state_u64(4),
            [
                0x77d3_2a34_8ad7_0d07,
                0x993e_d609_b84a_4fa5,
                0xd5f9_72de_c869_8e49,
                0x7d79_ebae_bcf1_48de
            ]
        );
    }

    #[test]
    fn pcg64_state_and_raw_draws_match_numpy() {
        let mut rng = Pcg64::from_seed(10007);
        assert_eq!(
            rng.state(),
            (
                78_698_009_995_358_412_790_897_477_648_799_726_887,
                228_559_182_809_729_053_680_923_842_009_152_786_877
            )
        );
        let raw: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            raw,
            [
                15_187_255_322_829_266_483,
                959_186_003_677_246_517,
                7_126_631_698_937_927_467
            ]
        );
    }

    #[test]
    fn bounded_integers_match_numpy() {
        // np.random.default_rng(10007).integers(0, 46539438283891, size=4, dtype=np.int64)
        let mut rng = Pcg64::from_seed(10007);
        let draws = rng.integers_i64(0, 46_539_438_283_891, 4);
        assert_eq!(
            draws,
            Some(vec![
                38_316_048_023_122,
                2_419_938_046_656,
                17_979_836_159_674,
                36_993_668_729_195
            ])
        );
    }

    #[test]
    fn other_seeds_and_ranges_match_numpy() {
        // 32-bit buffered path.
        let small = Pcg64::from_seed(10007).integers_i64(0, 1_000_000, 6);
        assert_eq!(
            small,
            Some(vec![149_995, 823_302, 619_956, 51_997, 547_788, 386_335])
        );
        // A seed wider than 64 bits and a negative low end.
        let wide =
            Pcg64::from_seed(123_456_789_012_345_678_901_234_567_890).integers_i64(-5, 1 << 40, 3);
        assert_eq!(
            wide,
            Some(vec![379_812_992_298, 369_197_710_561, 166_020_653_331])
        );
        let zero = Pcg64::from_seed(0).integers_i64(0, 1 << 62, 3);
        assert_eq!(
            zero,
            Some(vec![
                2_937_467_307_694_268_567,
                1_244_171_615_822_312_904,
                188_957_027_462_249_006
            ])
        );
        let full = Pcg64::from_seed(10007).integers_i64(i64::MIN, i64::MAX, 3);
        assert_eq!(
            full,
            Some(vec![
                5_963_883_285_974_490_674,
                -8_264_186_033_177_529_292,
                -2_096_740_337_916_848_342
            ])
        );
    }

    #[test]
    fn empty_range_is_rejected() {
        assert_eq!(Pcg64::from_seed(1).integers_i64(5, 5, 2), None);
        assert_eq!(
            Pcg64::from_seed(1).integers_i64(0, 1, 3),
            Some(vec![0, 0, 0])
        );
    }
}
