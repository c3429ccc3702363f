//! `Writer`: appends the smallest msgpack encoding of each value to a buffer.
//! Only lengths past 2^32 - 1 can fail.

use super::error::{WireError, WireResult};

/// Appends msgpack values to a byte buffer.
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// Writes after the contents of `buf`, reusing its allocation.
    pub fn from_vec(buf: Vec<u8>) -> Writer {
        Writer { buf }
    }

    pub fn reserve(&mut self, additional: usize) {
        self.buf.reserve(additional);
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    #[inline]
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    #[inline]
    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    #[inline]
    pub fn bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    #[inline]
    pub fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.raw(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.buf.push(0xcd);
            self.raw(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.buf.push(0xce);
            self.raw(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.raw(&v.to_be_bytes());
        }
    }

    #[inline]
    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.raw(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.buf.push(0xd1);
            self.raw(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.buf.push(0xd2);
            self.raw(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.raw(&v.to_be_bytes());
        }
    }

    #[inline]
    pub fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    #[inline]
    pub fn f32(&mut self, v: f32) {
        self.buf.push(0xca);
        self.raw(&v.to_bits().to_be_bytes());
    }

    #[inline]
    pub fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.raw(&v.to_bits().to_be_bytes());
    }

    /// An array header; fails only past 2^32 - 1 elements.
    #[inline]
    pub fn array_len(&mut self, n: usize, path: &str) -> WireResult<()> {
        if n < 16 {
            self.buf.push(0x90 | n as u8);
        } else if n <= u16::MAX as usize {
            self.buf.push(0xdc);
            self.raw(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdd);
            self.raw(&wire_len(n, path)?.to_be_bytes());
        }
        Ok(())
    }

    pub fn map_len(&mut self, n: usize, path: &str) -> WireResult<()> {
        if n < 16 {
            self.buf.push(0x80 | n as u8);
        } else if n <= u16::MAX as usize {
            self.buf.push(0xde);
            self.raw(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdf);
            self.raw(&wire_len(n, path)?.to_be_bytes());
        }
        Ok(())
    }

    pub fn str(&mut self, s: &str, path: &str) -> WireResult<()> {
        let n = s.len();
        if n < 32 {
            self.buf.push(0xa0 | n as u8);
        } else if n <= u8::MAX as usize {
            self.raw(&[0xd9, n as u8]);
        } else if n <= u16::MAX as usize {
            self.buf.push(0xda);
            self.raw(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdb);
            self.raw(&wire_len(n, path)?.to_be_bytes());
        }
        self.raw(s.as_bytes());
        Ok(())
    }

    #[inline]
    fn bin_header(&mut self, n: usize, path: &str) -> WireResult<()> {
        if n <= u8::MAX as usize {
            self.raw(&[0xc4, n as u8]);
        } else if n <= u16::MAX as usize {
            self.buf.push(0xc5);
            self.raw(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xc6);
            self.raw(&wire_len(n, path)?.to_be_bytes());
        }
        Ok(())
    }

    pub fn bin(&mut self, bytes: &[u8], path: &str) -> WireResult<()> {
        self.bin_header(bytes.len(), path)?;
        self.raw(bytes);
        Ok(())
    }

    /// A `u32` array as `bin` of raw little-endian bytes.
    #[inline]
    pub fn u32s(&mut self, values: &[u32], path: &str) -> WireResult<()> {
        self.bin_header(values.len().saturating_mul(4), path)?;
        let start = self.buf.len();
        self.buf.resize(start + values.len() * 4, 0);
        for (dst, v) in self.buf[start..].chunks_exact_mut(4).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// An `f32` array as `bin` of raw little-endian bytes (bit-exact, NaNs too).
    pub fn f32s(&mut self, values: &[f32], path: &str) -> WireResult<()> {
        self.bin_header(values.len().saturating_mul(4), path)?;
        let start = self.buf.len();
        self.buf.resize(start + values.len() * 4, 0);
        for (dst, v) in self.buf[start..].chunks_exact_mut(4).zip(values) {
            dst.copy_from_slice(&v.to_bits().to_le_bytes());
        }
        Ok(())
    }
}

#[cold]
fn too_long(n: usize, path: &str) -> WireError {
    WireError::encode(
        path,
        format!("{n} elements/bytes exceed msgpack's 2^32 - 1"),
    )
}

#[inline]
fn wire_len(n: usize, path: &str) -> WireResult<u32> {
    u32::try_from(n).map_err(|_| too_long(n, path))
}
