pub mod conformance;
pub mod model;
