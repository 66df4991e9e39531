//! IDX files (the MNIST format), optionally gzip-compressed, and data sets made of an image file
//! and a label file (MNIST, Fashion-MNIST).
//!
//! Format: two zero bytes, a type byte (0x08 = unsigned byte, the only type image sets use), the
//! number of dimensions, each dimension as a big-endian u32, then the data in row-major order.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::{Dataset, Example, Image};
use crate::bail;
use crate::error::{Context, Result};

/// Where Debian's `dataset-fashion-mnist` package installs Fashion-MNIST.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// A parsed IDX array of bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// Row-major data, `dims.iter().product()` bytes.
    pub data: Vec<u8>,
}

/// Parses IDX bytes (already decompressed). `what` names the source in errors.
pub fn parse_idx(bytes: &[u8], what: &str) -> Result<IdxArray> {
    if bytes.len() < 4 {
        bail!("{what}: not an IDX file: {} bytes, shorter than the 4-byte header", bytes.len());
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        bail!(
            "{what}: not an IDX file: magic starts {:#04x} {:#04x}, expected 0x00 0x00",
            bytes[0],
            bytes[1]
        );
    }
    if bytes[2] != 0x08 {
        bail!("{what}: IDX element type {:#04x} is not supported (only 0x08, unsigned byte)", bytes[2]);
    }
    let nd = bytes[3] as usize;
    if nd == 0 {
        bail!("{what}: IDX file with zero dimensions");
    }
    let header = 4 + 4 * nd;
    if bytes.len() < header {
        bail!("{what}: truncated IDX header: {nd} dimensions need {header} bytes, file has {}", bytes.len());
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| {
            u32::from_be_bytes([bytes[4 + 4 * i], bytes[5 + 4 * i], bytes[6 + 4 * i], bytes[7 + 4 * i]])
                as usize
        })
        .collect();
    let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let Some(count) = count else { bail!("{what}: IDX dimensions {dims:?} overflow") };
    let body = bytes.len() - header;
    if body != count {
        bail!(
            "{what}: IDX dimensions {dims:?} need {count} data bytes, file has {body} ({})",
            if body < count { "truncated" } else { "trailing bytes" }
        );
    }
    Ok(IdxArray { dims, data: bytes[header..].to_vec() })
}

/// Reads an IDX file, decompressing it when it is gzip (by its magic bytes, not its name).
pub fn read_idx(path: &Path) -> Result<IdxArray> {
    let raw = std::fs::read(path).context(|| format!("cannot read {}", path.display()))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .context(|| format!("{}: corrupt gzip data", path.display()))?;
        out
    } else {
        raw
    };
    parse_idx(&bytes, &path.display().to_string())
}

/// An image set from an IDX image file (N x H x W, grey) and an IDX label file (N).
#[derive(Debug)]
pub struct IdxDataset {
    images: IdxArray,
    labels: Vec<u8>,
    classes: usize,
    name: String,
}

/// Which file pair of an MNIST-style directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// `train-*`.
    Train,
    /// `t10k-*`.
    Test,
}

fn find(dir: &Path, stem: &str) -> Option<PathBuf> {
    [format!("{stem}.gz"), stem.to_string()].into_iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

impl IdxDataset {
    /// Builds a data set from parsed arrays, checking that they agree.
    pub fn from_arrays(images: IdxArray, labels: IdxArray, name: &str) -> Result<IdxDataset> {
        if images.dims.len() != 3 {
            bail!("{name}: image file has dimensions {:?}, expected N x rows x columns", images.dims);
        }
        if labels.dims.len() != 1 {
            bail!("{name}: label file has dimensions {:?}, expected N", labels.dims);
        }
        if images.dims[0] != labels.dims[0] {
            bail!("{name}: {} images but {} labels", images.dims[0], labels.dims[0]);
        }
        if images.dims[1] == 0 || images.dims[2] == 0 {
            bail!("{name}: empty images ({:?})", images.dims);
        }
        let classes = labels.data.iter().copied().max().map_or(0, |m| m as usize + 1);
        Ok(IdxDataset { images, labels: labels.data, classes, name: name.to_string() })
    }

    /// Opens `train-images-idx3-ubyte[.gz]` + `train-labels-idx1-ubyte[.gz]` (or `t10k-*`) in
    /// `dir`, with an error that says how to get the files when they are missing.
    pub fn open(dir: &Path, split: Split) -> Result<IdxDataset> {
        let prefix = match split {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        let hint = if dir == Path::new(FASHION_MNIST_DIR) {
            " (install Fashion-MNIST with `apt-get install dataset-fashion-mnist`, or pass --data DIR)"
        } else {
            ""
        };
        if !dir.is_dir() {
            bail!("data directory {} does not exist{hint}", dir.display());
        }
        let img = find(dir, &format!("{prefix}-images-idx3-ubyte"));
        let lab = find(dir, &format!("{prefix}-labels-idx1-ubyte"));
        let (Some(img), Some(lab)) = (img, lab) else {
            bail!(
                "{}: no {prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-idx1-ubyte[.gz] pair (an MNIST-format directory){hint}",
                dir.display()
            );
        };
        let name = format!("{} ({prefix})", dir.display());
        IdxDataset::from_arrays(read_idx(&img)?, read_idx(&lab)?, &name)
    }

    /// Keeps only the first `n` examples (for quick runs and tests).
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.labels.len());
        let per = self.images.dims[1] * self.images.dims[2];
        self.labels.truncate(n);
        self.images.data.truncate(n * per);
        self.images.dims[0] = n;
    }
}

impl Dataset for IdxDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn num_classes(&self) -> usize {
        self.classes
    }

    fn channels(&self) -> usize {
        1
    }

    fn get(&self, i: usize) -> Result<Example> {
        let (h, w) = (self.images.dims[1], self.images.dims[2]);
        let Some(pixels) = self.images.data.get(i * h * w..(i + 1) * h * w) else {
            bail!("{}: example {i} out of range", self.name);
        };
        Ok(Example {
            image: Image { height: h, width: w, channels: 1, pixels: pixels.to_vec() },
            label: self.labels[i] as u32,
        })
    }

    fn describe(&self) -> String {
        format!(
            "{}: {} images {}x{} grey, {} classes",
            self.name,
            self.len(),
            self.images.dims[1],
            self.images.dims[2],
            self.classes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut v = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            v.extend(d.to_be_bytes());
        }
        v.extend(data);
        v
    }

    #[test]
    fn parses_a_small_file() {
        let a = parse_idx(&idx(&[2, 2, 3], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]), "t").unwrap();
        assert_eq!(a.dims, vec![2, 2, 3]);
        assert_eq!(a.data[11], 12);
        let l = parse_idx(&idx(&[2], &[0, 9]), "l").unwrap();
        let d = IdxDataset::from_arrays(a, l, "t").unwrap();
        assert_eq!(d.num_classes(), 10);
        let e = d.get(1).unwrap();
        assert_eq!((e.label, e.image.pixels.clone()), (9, vec![7, 8, 9, 10, 11, 12]));
        assert!(d.get(2).is_err());
    }

    #[test]
    fn malformed_files_give_clear_errors() {
        let err = |b: &[u8]| parse_idx(b, "f").unwrap_err().0;
        assert!(err(&[0, 0]).contains("shorter than the 4-byte header"));
        assert!(err(&[0x50, 0x4b, 3, 4, 0, 0]).contains("not an IDX file"));
        assert!(err(&[0, 0, 0x0d, 1, 0, 0, 0, 0]).contains("not supported"));
        assert!(err(&[0, 0, 8, 3, 0, 0, 0, 1]).contains("truncated IDX header"));
        assert!(err(&idx(&[2, 2], &[1, 2, 3])).contains("truncated"));
        assert!(err(&idx(&[1, 2], &[1, 2, 3])).contains("trailing bytes"));
        let a = parse_idx(&idx(&[2, 1, 1], &[1, 2]), "i").unwrap();
        let l = parse_idx(&idx(&[3], &[0, 1, 2]), "l").unwrap();
        assert!(IdxDataset::from_arrays(a.clone(), l, "x").unwrap_err().0.contains("2 images but 3 labels"));
        assert!(IdxDataset::from_arrays(a.clone(), a, "x").unwrap_err().0.contains("expected N"));
    }

    #[test]
    fn missing_directory_and_files_say_what_to_do() {
        let e = IdxDataset::open(Path::new("/nonexistent/fmnist"), Split::Train).unwrap_err().0;
        assert!(e.contains("does not exist"), "{e}");
        let dir = std::env::temp_dir().join(format!("toroid-idx-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = IdxDataset::open(&dir, Split::Test).unwrap_err().0;
        assert!(e.contains("t10k-images-idx3-ubyte"), "{e}");
        // A corrupt gzip file is reported with its path.
        std::fs::write(dir.join("t10k-images-idx3-ubyte.gz"), [0x1f, 0x8b, 8, 0, 1, 2, 3]).unwrap();
        std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx(&[1], &[0])).unwrap();
        let e = IdxDataset::open(&dir, Split::Test).unwrap_err().0;
        assert!(e.contains("corrupt gzip") && e.contains("t10k-images"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
