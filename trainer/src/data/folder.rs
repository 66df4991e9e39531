//! Class-per-directory image sets (torchvision's ImageFolder, the layout ImageNet is shipped in):
//! `root/<class>/<image>.{jpg,jpeg,png}`, classes numbered in sorted directory-name order.

use std::path::{Path, PathBuf};

use super::{Dataset, Example, Image};
use crate::bail;
use crate::error::{Context, Result};

const EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// An ImageFolder data set: file paths and labels; images are decoded on demand by the
/// pipeline's worker threads.
#[derive(Debug)]
pub struct FolderDataset {
    root: PathBuf,
    classes: Vec<String>,
    files: Vec<(PathBuf, u32)>,
    channels: usize,
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .context(|| format!("cannot list {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .context(|| format!("cannot list {}", dir.display()))?;
    v.sort();
    Ok(v)
}

impl FolderDataset {
    /// Scans `root`. `channels` is 3 (decode to RGB) or 1 (to grey). Fails when `root` is
    /// missing, has no class directories, or a class has no images.
    pub fn open(root: &Path, channels: usize) -> Result<FolderDataset> {
        if channels != 1 && channels != 3 {
            bail!("image folders decode to 1 or 3 channels, not {channels}");
        }
        if !root.is_dir() {
            bail!(
                "image folder {} does not exist (expected {}/<class>/<image>.jpg)",
                root.display(),
                root.display()
            );
        }
        let dirs: Vec<PathBuf> = sorted_entries(root)?.into_iter().filter(|p| p.is_dir()).collect();
        if dirs.is_empty() {
            bail!(
                "image folder {} has no class directories (expected {}/<class>/<image>.jpg)",
                root.display(),
                root.display()
            );
        }
        let mut classes = vec![];
        let mut files = vec![];
        let mut empty = vec![];
        for (label, d) in dirs.iter().enumerate() {
            let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let before = files.len();
            for f in sorted_entries(d)? {
                let ext = f.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                if f.is_file() && EXTENSIONS.contains(&ext.as_str()) {
                    files.push((f, label as u32));
                }
            }
            if files.len() == before {
                empty.push(name.clone());
            }
            classes.push(name);
        }
        if !empty.is_empty() {
            bail!(
                "image folder {}: no .jpg/.jpeg/.png files in class directories {:?}",
                root.display(),
                empty
            );
        }
        Ok(FolderDataset { root: root.to_path_buf(), classes, files, channels })
    }

    /// Class names in label order.
    pub fn class_names(&self) -> &[String] {
        &self.classes
    }
}

impl Dataset for FolderDataset {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn num_classes(&self) -> usize {
        self.classes.len()
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn get(&self, i: usize) -> Result<Example> {
        let Some((path, label)) = self.files.get(i) else {
            bail!("{}: example {i} out of range", self.root.display())
        };
        let img = image::ImageReader::open(path)
            .context(|| format!("cannot open {}", path.display()))?
            .with_guessed_format()
            .context(|| format!("cannot read {}", path.display()))?
            .decode()
            .context(|| format!("cannot decode {}", path.display()))?;
        let (width, height) = (img.width() as usize, img.height() as usize);
        let pixels =
            if self.channels == 3 { img.into_rgb8().into_raw() } else { img.into_luma8().into_raw() };
        Ok(Example { image: Image { height, width, channels: self.channels, pixels }, label: *label })
    }

    fn describe(&self) -> String {
        format!("{}: {} images in {} classes", self.root.display(), self.files.len(), self.classes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_classes_in_order_and_decodes_png_and_jpeg() {
        let root = std::env::temp_dir().join(format!("toroid-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (class, n) in [("cat", 2), ("ant", 1)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..n {
                let img =
                    image::RgbImage::from_fn(5, 4, |x, y| image::Rgb([x as u8 * 10, y as u8 * 10, i as u8]));
                let ext = if i == 0 { "png" } else { "jpg" };
                img.save(root.join(class).join(format!("{i}.{ext}"))).unwrap();
            }
        }
        std::fs::write(root.join("cat").join("notes.txt"), "ignored").unwrap();
        let d = FolderDataset::open(&root, 3).unwrap();
        assert_eq!(d.class_names(), &["ant".to_string(), "cat".to_string()]);
        assert_eq!(d.len(), 3);
        let e = d.get(0).unwrap();
        assert_eq!((e.label, e.image.width, e.image.height, e.image.channels), (0, 5, 4, 3));
        let e = d.get(1).unwrap(); // cat/0.png, lossless
        assert_eq!(e.label, 1);
        assert_eq!(&e.image.pixels[3 * 6..3 * 6 + 3], &[10, 10, 0]);
        assert_eq!(FolderDataset::open(&root, 1).unwrap().get(2).unwrap().image.pixels.len(), 20);

        // A corrupt image is an error naming the file, not a panic.
        std::fs::write(root.join("ant").join("bad.jpg"), b"not a jpeg").unwrap();
        let d = FolderDataset::open(&root, 3).unwrap();
        let e = d.get(1).unwrap_err().0; // ant/0.png, ant/bad.jpg, cat/...
        assert!(e.contains("bad.jpg"), "{e}");

        // An empty class directory is named.
        std::fs::create_dir_all(root.join("zebra")).unwrap();
        let e = FolderDataset::open(&root, 3).unwrap_err().0;
        assert!(e.contains("zebra"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
        assert!(FolderDataset::open(&root, 3).unwrap_err().0.contains("does not exist"));
    }
}
