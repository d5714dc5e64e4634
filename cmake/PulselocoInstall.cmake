# Install rules and the CMake package: an installed copy is found with find_package(pulseloco)
# and used through the target pulseloco::pulseloco (tests/consumer proves it).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(PULSELOCO_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/pulseloco")

install(TARGETS ${PULSELOCO_COMPONENTS} pulseloco pulseloco_compile_options
  EXPORT pulselocoTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS pulseloco_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Headers keep their layout under include/pulseloco/: "base/errors.h", "kernels/...", and the
# public API header <pulseloco/pulseloco.h>.
foreach(dir src/base src/codec src/io src/engine src/torch_adapter kernels transport collectives)
  if(EXISTS ${PROJECT_SOURCE_DIR}/${dir})
    get_filename_component(name ${dir} NAME)
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/
      DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco/${name}
      FILES_MATCHING PATTERN "*.h" PATTERN "*.cuh")
  endif()
endforeach()
if(EXISTS ${PROJECT_SOURCE_DIR}/src/pulseloco)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/pulseloco/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco FILES_MATCHING PATTERN "*.h")
endif()
install(FILES ${PROJECT_BINARY_DIR}/generated/base/build_config.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco/base)

install(EXPORT pulselocoTargets
  NAMESPACE pulseloco::
  DESTINATION ${PULSELOCO_INSTALL_CMAKEDIR})

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/pulselocoConfig.cmake.in
  ${PROJECT_BINARY_DIR}/pulselocoConfig.cmake
  INSTALL_DESTINATION ${PULSELOCO_INSTALL_CMAKEDIR})
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/pulselocoConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/pulselocoConfig.cmake
  ${PROJECT_BINARY_DIR}/pulselocoConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/Findxxhash.cmake
  ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
  ${PROJECT_SOURCE_DIR}/cmake/PulselocoCudaToolkit.cmake
  DESTINATION ${PULSELOCO_INSTALL_CMAKEDIR})
