//! Which return values a probe's `on_return` rules pick, compared as the
//! kernel compares them (sign-extended from 32 bits with `ret = "i32"`):
//! enough to refuse a rule that can never pick its event, and two probes
//! that would both emit for one call.
use serde::Deserialize;
use stallwatch_common::{RetRule, cmp};

/// Width of the return value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetType {
    #[default]
    I64,
    /// A C `int` (a status enum): only the low 32 bits of `rax` are defined.
    I32,
    /// An unsigned byte (a flag): the low 8 bits, zero-extended.
    U8,
    /// An unsigned 16-bit value (a status code in a struct): the low 16
    /// bits, zero-extended.
    U16,
}

impl RetType {
    /// The slot flag that widens a value of this type
    /// ([`stallwatch_common::widen`]).
    pub fn flag(self) -> u32 {
        use stallwatch_common::slot_flags;
        match self {
            Self::I64 => 0,
            Self::I32 => slot_flags::RET_I32,
            Self::U8 => slot_flags::RET_U8,
            Self::U16 => slot_flags::RET_U16,
        }
    }

    /// Its name in a profile.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::I64 => "i64",
            Self::I32 => "i32",
            Self::U8 => "u8",
            Self::U16 => "u16",
        }
    }

    /// Bytes it takes in memory.
    pub fn width(self) -> usize {
        match self {
            Self::I64 => 8,
            Self::I32 => 4,
            Self::U16 => 2,
            Self::U8 => 1,
        }
    }

    /// What a value of this type can be, for an error about a rule that
    /// never holds.
    pub fn range(self) -> String {
        let (lo, hi) = bounds(self);
        match self {
            Self::I64 => "no 64-bit value satisfies it".to_owned(),
            _ => format!("a \"{}\" value is between {lo} and {hi}", self.as_str()),
        }
    }
}

/// A set of return values: inclusive ranges (they may overlap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Values(Vec<(i128, i128)>);

impl Values {
    /// No value.
    pub fn none() -> Self {
        Self(Vec::new())
    }

    /// Every value a return of type `ret` can have.
    pub fn all(ret: RetType) -> Self {
        Self(vec![bounds(ret)])
    }

    /// The values of type `ret` for which `rule` holds.
    pub fn held_by(rule: &RetRule, ret: RetType) -> Self {
        let (lo, hi) = bounds(ret);
        let v = i128::from(rule.value);
        let ranges = match rule.op {
            cmp::EQ => vec![(v, v)],
            cmp::NE => vec![(lo, v - 1), (v + 1, hi)],
            cmp::LT => vec![(lo, v - 1)],
            cmp::LE => vec![(lo, v)],
            cmp::GT => vec![(v + 1, hi)],
            cmp::GE => vec![(v, hi)],
            _ => Vec::new(),
        };
        Self(ranges.into_iter().map(|(a, b)| (a.max(lo), b.min(hi))).filter(|(a, b)| a <= b).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn intersects(&self, other: &Self) -> bool {
        self.0.iter().any(|&(a, b)| other.0.iter().any(|&(c, d)| a.max(c) <= b.min(d)))
    }

    /// These values without `other`'s.
    pub fn minus(&self, other: &Self) -> Self {
        let mut left = self.0.clone();
        for &(c, d) in &other.0 {
            left = left
                .into_iter()
                .flat_map(|(a, b)| [(a, b.min(c - 1)), (a.max(d + 1), b)])
                .filter(|(a, b)| a <= b)
                .collect();
        }
        Self(left)
    }

    /// These values and `other`'s.
    pub fn union(mut self, other: Self) -> Self {
        self.0.extend(other.0);
        self
    }
}

fn bounds(ret: RetType) -> (i128, i128) {
    match ret {
        RetType::I64 => (i128::from(i64::MIN), i128::from(i64::MAX)),
        RetType::I32 => (i128::from(i32::MIN), i128::from(i32::MAX)),
        RetType::U8 => (0, i128::from(u8::MAX)),
        RetType::U16 => (0, i128::from(u16::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(op: u8, value: i64) -> RetRule {
        RetRule { op, stage: 0, _pad: [0; 6], value }
    }

    #[test]
    fn an_i32_is_never_a_value_beyond_32_bits() {
        assert!(Values::held_by(&rule(cmp::EQ, 99_999_999_999_999), RetType::I32).is_empty());
        assert!(!Values::held_by(&rule(cmp::EQ, 99_999_999_999_999), RetType::I64).is_empty());
        assert!(Values::held_by(&rule(cmp::LT, i64::from(i32::MIN)), RetType::I32).is_empty());
        assert!(Values::held_by(&rule(cmp::LT, i64::MIN), RetType::I64).is_empty());
        assert_eq!(Values::held_by(&rule(cmp::NE, 5), RetType::I32).minus(&Values::all(RetType::I32)), Values(vec![]));
    }

    #[test]
    fn unsigned_narrow_values_are_never_negative_nor_past_their_width() {
        assert!(Values::held_by(&rule(cmp::LT, 0), RetType::U8).is_empty());
        assert!(Values::held_by(&rule(cmp::EQ, 256), RetType::U8).is_empty());
        assert!(!Values::held_by(&rule(cmp::EQ, 255), RetType::U8).is_empty());
        assert!(Values::held_by(&rule(cmp::GT, 65535), RetType::U16).is_empty());
        assert_eq!(Values::held_by(&rule(cmp::NE, 0), RetType::U16), Values(vec![(1, 65535)]));
        // The kernel's widening keeps exactly those bits.
        use stallwatch_common::{slot_flags, widen};
        assert_eq!(widen(RetType::U16.flag(), 0x7fc6_a400_0004), 4);
        assert_eq!(widen(RetType::U8.flag(), 0x0101), 1);
        assert_eq!(widen(RetType::I32.flag(), 0xffff_ffff), -1);
        assert_eq!(widen(RetType::I64.flag(), 0xffff_ffff), 0xffff_ffff);
        assert_eq!(RetType::U16.flag(), slot_flags::RET_U16);
    }

    #[test]
    fn earlier_rules_take_their_values_first() {
        let negative = Values::held_by(&rule(cmp::LT, 0), RetType::I32);
        let left = Values::all(RetType::I32).minus(&negative);
        assert!(!left.intersects(&Values::held_by(&rule(cmp::EQ, -3), RetType::I32)));
        assert!(left.intersects(&Values::held_by(&rule(cmp::EQ, 0), RetType::I32)));
        let zero = Values::held_by(&rule(cmp::EQ, 0), RetType::I32);
        assert!(
            !Values::held_by(&rule(cmp::GE, 0), RetType::I32)
                .minus(&zero)
                .minus(&Values::held_by(&rule(cmp::GT, 0), RetType::I32))
                .intersects(&Values::all(RetType::I32))
        );
    }
}
