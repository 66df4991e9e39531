//! File store: one file per key in a directory every rank can see.
//! (Being written: see the rendezvous task.)

use std::path::Path;
use std::time::Duration;

use super::Store;
use crate::error::Result;

/// A store kept in a directory of a shared file system.
#[derive(Debug)]
pub struct FileStore {
    _private: (),
}

impl FileStore {
    /// Opens (creating if needed) the store directory `path`.
    pub fn new(_path: impl AsRef<Path>) -> Result<FileStore> {
        unimplemented!("FileStore::new")
    }
}

impl Store for FileStore {
    fn set(&self, _key: &str, _value: &[u8]) -> Result<()> {
        unimplemented!()
    }
    fn get(&self, _key: &str, _timeout: Duration) -> Result<Vec<u8>> {
        unimplemented!()
    }
    fn add(&self, _key: &str, _delta: i64) -> Result<i64> {
        unimplemented!()
    }
    fn wait(&self, _keys: &[&str], _timeout: Duration) -> Result<()> {
        unimplemented!()
    }
    fn delete(&self, _key: &str) -> Result<bool> {
        unimplemented!()
    }
}
