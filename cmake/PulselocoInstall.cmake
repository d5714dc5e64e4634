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

# Headers go under include/pulseloco/<component>/ exactly as the build tree includes them
# (cmake/PulselocoIncludeTree.cmake), and include/ is the only include root an installed
# pulseloco adds: users write <pulseloco/pulseloco.h>, <pulseloco/engine/engine.h>.
foreach(entry ${PULSELOCO_HEADER_FOLDERS})
  string(REPLACE "=" ";" pair ${entry})
  list(GET pair 0 name)
  list(GET pair 1 folder)
  if(EXISTS ${PROJECT_SOURCE_DIR}/${folder} AND NOT name STREQUAL "cli")
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder}/
      DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco/${name}
      FILES_MATCHING PATTERN "*.h" PATTERN "*.cuh")
  endif()
endforeach()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/pulseloco/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco FILES_MATCHING PATTERN "*.h")
install(FILES ${PULSELOCO_INCLUDE_DIR}/pulseloco/build_config.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco)

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
