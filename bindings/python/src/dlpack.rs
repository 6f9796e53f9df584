//! DLPack (the `dlpark` crate): zero-copy exchange with PyTorch and any `__dlpack__` producer.
//!
//! - [`dlpack_to_numpy`] imports a producer's tensor (`torch.Tensor`, a JAX or CuPy array, a
//!   DLPack capsule) as a NumPy array over the same memory: no copy; the array's `base` keeps
//!   the producer's buffer alive (dlpark's exactly-once deleter), and writes through the array
//!   are writes to the tensor (in-place functions such as `apply_token_bitmask_inplace`).
//! - [`DlpackView`] exports a NumPy array through `__dlpack__` / `__dlpack_device__`, so that
//!   `torch.from_dlpack(view)` is a tensor over the array's memory (no copy), bfloat16
//!   (`ml_dtypes.bfloat16`) included, which NumPy's own `__dlpack__` cannot export.
//!
//! Only CPU memory is accepted: nucleus runs on the CPU, and a tensor on another device gets
//! a `ValueError` that names the device rather than a silent copy.

use std::ffi::c_void;

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, from_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use numpy::npyffi::{self, npy_intp, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{Element, PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The DLPack element types nucleus exchanges: `(code, bits)` and the NumPy dtype name.
const DTYPES: [(DLDataTypeCode, u8, &str); 12] = [
    (DLDataTypeCode::FLOAT, 32, "float32"),
    (DLDataTypeCode::FLOAT, 16, "float16"),
    (DLDataTypeCode::BFLOAT, 16, "bfloat16"),
    (DLDataTypeCode::FLOAT, 64, "float64"),
    (DLDataTypeCode::INT, 8, "int8"),
    (DLDataTypeCode::INT, 16, "int16"),
    (DLDataTypeCode::INT, 32, "int32"),
    (DLDataTypeCode::INT, 64, "int64"),
    (DLDataTypeCode::UINT, 8, "uint8"),
    (DLDataTypeCode::UINT, 32, "uint32"),
    (DLDataTypeCode::UINT, 64, "uint64"),
    (DLDataTypeCode::BOOL, 8, "bool"),
];

/// Owns an imported tensor: the `base` of the NumPy view, dropped (and the producer's deleter
/// called, exactly once) when the last view of it goes.
#[pyclass(frozen, module = "nucleus._core")]
struct DlpackOwner {
    _deleter: dlpark::AllocationDeleter,
}

fn device_name(device: DLDevice) -> String {
    let name = match device.device_type {
        DLDeviceType::CPU => "cpu",
        DLDeviceType::CUDA => "cuda",
        DLDeviceType::CUDAHOST => "cuda_host",
        DLDeviceType::ROCM => "rocm",
        DLDeviceType::METAL => "metal",
        DLDeviceType::VULKAN => "vulkan",
        DLDeviceType::ONEAPI => "oneapi",
        _ => return format!("DLPack device type {}", device.device_type.0),
    };
    format!("{name}:{}", device.device_id)
}

/// Imports `obj` (any DLPack producer, or a DLPack capsule) as a NumPy array over the same
/// memory, without copying.
///
/// Shape and strides are the tensor's (strides in elements become NumPy's byte strides; a
/// tensor without strides is C-contiguous). The array is writable unless the producer
/// flagged the tensor read-only (DLPack 1.0's `READ_ONLY`).
///
/// Errors: `TypeError` when `obj` speaks no DLPack; `ValueError` for a tensor outside CPU
/// memory (CPU or CUDA-pinned host memory are accepted), an element type nucleus does not
/// take (see the module docs), or a malformed descriptor; an `ImportError` for a bfloat16
/// tensor without `ml_dtypes` installed.
#[pyfunction]
fn dlpack_to_numpy<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let imported = from_dlpack(obj.as_borrowed(), None, None)?;
    let read_only = imported.flags().contains(DlpackFlags::READ_ONLY);
    let (data, shape, strides, dtype) = {
        let t = imported
            .validate()
            .map_err(|e| PyValueError::new_err(format!("a malformed DLPack tensor: {e}")))?;
        let device = t.device();
        if device.device_type != DLDeviceType::CPU && device.device_type != DLDeviceType::CUDAHOST {
            return Err(PyValueError::new_err(format!(
                "nucleus runs on the CPU: the tensor is on {}; move it to the CPU first \
                 (torch: `.cpu()`)",
                device_name(device)
            )));
        }
        let strides = t
            .strides_or_compact()
            .map_err(|e| PyValueError::new_err(format!("a malformed DLPack tensor: {e}")))?
            .into_owned();
        let base = t.data_ptr() as *mut u8;
        let data = if base.is_null() {
            base
        } else {
            base.wrapping_add(t.byte_offset() as usize)
        };
        (data, t.shape().to_vec(), strides, t.dtype())
    };
    let name = DTYPES
        .iter()
        .find(|(code, bits, _)| dtype.code == *code && dtype.bits == *bits && dtype.lanes == 1)
        .map(|(_, _, name)| *name)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "nucleus does not take DLPack element type (code {}, {} bits, {} lanes); it \
                 takes float32, float16, bfloat16, float64, int8/16/32/64, uint8/32/64 and bool",
                dtype.code.0, dtype.bits, dtype.lanes
            ))
        })?;
    let descr = numpy_dtype(py, name)?;
    let item = (dtype.bits / 8) as i64;
    let mut dims: Vec<npy_intp> = shape.iter().map(|&d| d as npy_intp).collect();
    let mut byte_strides = Vec::with_capacity(strides.len());
    for &s in &strides {
        let bytes = s
            .checked_mul(item)
            .ok_or_else(|| PyValueError::new_err("a DLPack stride overflows"))?;
        byte_strides.push(bytes as npy_intp);
    }
    let owner = Bound::new(
        py,
        DlpackOwner {
            _deleter: imported.into_deleter(),
        },
    )?;
    let flags = if read_only { 0 } else { NPY_ARRAY_WRITEABLE };
    // SAFETY: the descriptor was validated by dlpark (shape and strides readable, CPU memory);
    // `data` points into the producer's buffer, which `owner` keeps alive for as long as the
    // array (its base) lives. NewFromDescr steals the dtype reference; SetBaseObject steals
    // the owner reference.
    unsafe {
        let array = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            dims.len() as std::os::raw::c_int,
            dims.as_mut_ptr(),
            byte_strides.as_mut_ptr(),
            data as *mut c_void,
            flags,
            std::ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, array)?;
        if PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            array.as_ptr() as *mut npyffi::PyArrayObject,
            owner.into_ptr(),
        ) != 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(array)
    }
}

fn numpy_dtype<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArrayDescr>> {
    match name {
        "float32" => Ok(f32::get_dtype(py)),
        "float16" => Ok(half::f16::get_dtype(py)),
        "bfloat16" => {
            py.import("ml_dtypes").map_err(|e| {
                pyo3::exceptions::PyImportError::new_err(format!(
                    "a bfloat16 tensor needs the ml_dtypes package (pip install ml_dtypes): {e}"
                ))
            })?;
            PyArrayDescr::new(py, "bfloat16")
        }
        "float64" => Ok(f64::get_dtype(py)),
        "int8" => Ok(i8::get_dtype(py)),
        "int16" => Ok(i16::get_dtype(py)),
        "int32" => Ok(i32::get_dtype(py)),
        "int64" => Ok(i64::get_dtype(py)),
        "uint8" => Ok(u8::get_dtype(py)),
        "uint32" => Ok(u32::get_dtype(py)),
        "uint64" => Ok(u64::get_dtype(py)),
        _ => Ok(bool::get_dtype(py)),
    }
}

/// A NumPy array exported through the DLPack protocol: `torch.from_dlpack(DlpackView(a))` is a
/// tensor over `a`'s memory (no copy), which the view keeps alive.
///
/// `DlpackView(array, dtype_name)`: `array` a NumPy array in native byte order whose strides
/// are whole elements, `dtype_name` its element type's name (`array.dtype.name`: float32,
/// float16, bfloat16, ...). A read-only array is exported with DLPack's `READ_ONLY` flag
/// (versioned ABI); a consumer that asks for the legacy ABI cannot be told, so a read-only
/// array is refused for it.
///
/// Errors: `TypeError` for something that is not a NumPy array; `ValueError` for an element
/// type outside the module's list, a stride that is not a whole number of elements.
#[pyclass(frozen, module = "nucleus._core")]
pub(crate) struct DlpackView {
    array: Py<PyAny>,
    data: usize,
    shape: Vec<i64>,
    strides: Vec<i64>,
    dtype: DLDataType,
    read_only: bool,
}

#[pymethods]
impl DlpackView {
    #[new]
    fn new(array: &Bound<'_, PyAny>, dtype_name: &str) -> PyResult<Self> {
        let untyped = array.cast::<PyUntypedArray>().map_err(|_| {
            PyTypeError::new_err(format!(
                "DlpackView takes a NumPy array, not {}",
                array.get_type()
            ))
        })?;
        let (code, bits) = DTYPES
            .iter()
            .find(|(_, _, name)| *name == dtype_name)
            .map(|(code, bits, _)| (*code, *bits))
            .ok_or_else(|| {
                PyValueError::new_err(format!("cannot export dtype {dtype_name} through DLPack"))
            })?;
        let item = i64::from(bits / 8);
        if untyped.dtype().itemsize() as i64 != item {
            return Err(PyValueError::new_err(format!(
                "dtype {dtype_name} does not match the array's item size {}",
                untyped.dtype().itemsize()
            )));
        }
        let shape: Vec<i64> = untyped.shape().iter().map(|&d| d as i64).collect();
        let mut strides = Vec::with_capacity(shape.len());
        for &s in untyped.strides() {
            let s = s as i64;
            if s % item != 0 {
                return Err(PyValueError::new_err(format!(
                    "a stride of {s} bytes is not a whole number of {item}-byte elements"
                )));
            }
            strides.push(s / item);
        }
        // SAFETY: `untyped` is a live NumPy array; reading its object fields is sound.
        let (data, flags) = unsafe {
            let raw = untyped.as_array_ptr();
            ((*raw).fields.data as usize, (*raw).fields.flags)
        };
        Ok(DlpackView {
            array: array.clone().unbind(),
            data,
            shape,
            strides,
            dtype: DLDataType::scalar(code, bits),
            read_only: flags & NPY_ARRAY_WRITEABLE == 0,
        })
    }

    /// The DLPack protocol (Python array API): a capsule for this array's memory.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDeviceType::CPU.0, 0)
    }
}

impl DlpackView {
    fn export<M: ManagedTensorBase>(&self, py: Python<'_>) -> PyResult<Managed<M>> {
        let prepared = Dynamic::new(self.shape.as_slice(), self.strides.as_slice())
            .prepare_as::<M>()
            .map_err(|e| PyValueError::new_err(format!("exporting through DLPack: {e}")))?;
        let mut initialized = prepared.initialize(Box::new(self.array.clone_ref(py)));
        let empty = self.shape.contains(&0);
        initialized
            .set_data(if empty {
                std::ptr::null_mut()
            } else {
                self.data as *mut c_void
            })
            .set_dtype(self.dtype)
            .set_device(DLDevice::CPU);
        initialized
            .set_flags(DlpackExporter::flags(self))
            .map_err(|e| PyValueError::new_err(format!("exporting through DLPack: {e}")))?;
        // SAFETY: the data, shape and strides describe the NumPy array, which the boxed
        // reference (the manager context) keeps alive until the consumer's deleter runs.
        Ok(unsafe { initialized.finish() })
    }
}

impl DlpackExporter for DlpackView {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        if self.read_only {
            DlpackFlags::READ_ONLY
        } else {
            DlpackFlags::empty()
        }
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        // dlpark refuses the legacy ABI for a read-only array (no flags to carry it).
        self.export(py)
    }

    fn export_versioned(&self, py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.export(py)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dlpack_to_numpy, m)?)?;
    m.add_class::<DlpackView>()?;
    m.add_class::<DlpackOwner>()?;
    Ok(())
}
