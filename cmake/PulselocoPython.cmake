# The Python package (src/adapters/python, python/pulseloco): option PULSELOCO_BUILD_PYTHON and
# the interpreter and nanobind it builds against.
#
# The interpreter is PULSELOCO_PYTHON (the venv ./scripts/deps makes); under scikit-build-core
# (`pip install .`, `pip wheel .`) it is the interpreter building the wheel. nanobind is found
# through that interpreter (`-m nanobind --cmake_dir`), so it is the venv's own.
if(DEFINED SKBUILD AND DEFINED Python_EXECUTABLE)
  set(PULSELOCO_PYTHON "${Python_EXECUTABLE}")
else()
  set(PULSELOCO_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH
    "Python interpreter of the venv (numpy, torch, safetensors, nanobind, pytest)")
endif()

set(_pulseloco_nanobind_dir "")
if(EXISTS "${PULSELOCO_PYTHON}")
  execute_process(COMMAND "${PULSELOCO_PYTHON}" -m nanobind --cmake_dir
    OUTPUT_VARIABLE _pulseloco_nanobind_dir OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _pulseloco_nanobind_rc ERROR_QUIET)
  if(NOT _pulseloco_nanobind_rc EQUAL 0)
    set(_pulseloco_nanobind_dir "")
  endif()
endif()
set(_pulseloco_python_default OFF)
if(_pulseloco_nanobind_dir)
  set(_pulseloco_python_default ON)
endif()
option(PULSELOCO_BUILD_PYTHON
  "Build the Python package (needs PULSELOCO_PYTHON with nanobind)" ${_pulseloco_python_default})

if(PULSELOCO_BUILD_PYTHON)
  if(NOT _pulseloco_nanobind_dir)
    message(FATAL_ERROR "PULSELOCO_BUILD_PYTHON=ON but '${PULSELOCO_PYTHON} -m nanobind "
      "--cmake_dir' failed: run ./scripts/deps, or set PULSELOCO_PYTHON to an interpreter with "
      "nanobind")
  endif()
  set(Python_EXECUTABLE "${PULSELOCO_PYTHON}")
  find_package(Python 3.8 REQUIRED COMPONENTS Interpreter Development.Module)
  find_package(nanobind CONFIG REQUIRED PATHS "${_pulseloco_nanobind_dir}" NO_DEFAULT_PATH)
  set(PULSELOCO_PYTHON_DETAIL "Python ${Python_VERSION}, nanobind ${nanobind_VERSION}")
else()
  set(PULSELOCO_PYTHON_DETAIL "off (no nanobind for ${PULSELOCO_PYTHON})")
endif()
