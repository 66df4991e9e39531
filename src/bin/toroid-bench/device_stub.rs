//! `--device` when toroid-bench is built without the `cuda` feature: refused.
use toroid::{Communicator, DataType, Error, OpKind, Result};

pub enum DeviceBufs {}

impl DeviceBufs {
    pub fn new(_: usize, _: usize, _: usize) -> Result<DeviceBufs> {
        Err(Error::Unsupported(
            "CUDA is not available: toroid-bench was built without the `cuda` feature".into(),
        ))
    }
    pub fn upload(&mut self, _: &[u8], _: &[u8]) -> Result<()> {
        match *self {}
    }
    pub fn sync(&self) -> Result<()> {
        match *self {}
    }
    pub fn download(&mut self, _: &mut [u8]) -> Result<()> {
        match *self {}
    }
    pub fn run(&self, _: &Communicator, _: OpKind, _: usize, _: DataType, _: bool) -> Result<()> {
        match *self {}
    }
}

pub fn route(_: &Communicator, _: OpKind) -> &'static str {
    "none"
}
