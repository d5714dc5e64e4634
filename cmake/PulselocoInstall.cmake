# Install rules and the CMake package. An installed pulseloco is found with
#   find_package(pulseloco [COMPONENTS core cuda nccl mpi torch])
# and used through pulseloco::pulseloco (every component found) or pulseloco::core,
# pulseloco::cuda, ... (tests/consumer proves both). Each package component has its own export
# file, so that a consumer without CUDA, NCCL, MPI or libtorch can still use `core`.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(PULSELOCO_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/pulseloco")

set(PULSELOCO_BUILT_PACKAGE_COMPONENTS "")
foreach(package_component ${PULSELOCO_PACKAGE_COMPONENTS})
  get_property(targets GLOBAL PROPERTY PULSELOCO_COMPONENT_${package_component})
  if(package_component STREQUAL "core")
    list(APPEND targets pulseloco_compile_options)
  endif()
  if(NOT targets)
    continue()
  endif()
  list(APPEND PULSELOCO_BUILT_PACKAGE_COMPONENTS ${package_component})
  # In the package: pulseloco::base, pulseloco::engine, ... as in the build tree.
  foreach(target ${targets})
    string(REGEX REPLACE "^pulseloco_" "" export_name ${target})
    set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
  endforeach()
  install(TARGETS ${targets}
    EXPORT pulseloco-${package_component}-targets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT pulseloco-${package_component}-targets
    NAMESPACE pulseloco::
    DESTINATION ${PULSELOCO_INSTALL_CMAKEDIR})
  list(REMOVE_ITEM targets pulseloco_compile_options)
  set(PULSELOCO_PACKAGE_TARGETS_${package_component} ${targets})
endforeach()
install(TARGETS pulseloco_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Headers go under include/pulseloco/<component>/ exactly as the build tree includes them
# (cmake/PulselocoIncludeTree.cmake), and include/ is the only include root an installed
# pulseloco adds: users write <pulseloco/pulseloco.h>, <pulseloco/engine/engine.h>. Internal
# headers stay out: those under detail/ and those whose first line says so ("// Internal: ..."
# or "(internal header)"); an installed header never includes one.
foreach(entry ${PULSELOCO_HEADER_FOLDERS})
  string(REPLACE "=" ";" pair ${entry})
  list(GET pair 0 name)
  list(GET pair 1 folder)
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/${folder} OR name STREQUAL "cli")
    continue()
  endif()
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/${folder}
    ${PROJECT_SOURCE_DIR}/${folder}/*.h ${PROJECT_SOURCE_DIR}/${folder}/*.cuh)
  foreach(header ${headers})
    file(STRINGS ${PROJECT_SOURCE_DIR}/${folder}/${header} first_line LIMIT_COUNT 1)
    if(header MATCHES "(^|/)detail/" OR first_line MATCHES "^// Internal|internal header")
      continue()
    endif()
    get_filename_component(subfolder ${header} DIRECTORY)
    install(FILES ${PROJECT_SOURCE_DIR}/${folder}/${header}
      DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco/${name}/${subfolder})
  endforeach()
endforeach()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/src/pulseloco/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco FILES_MATCHING PATTERN "*.h")
install(FILES ${PULSELOCO_INCLUDE_DIR}/pulseloco/build_config.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pulseloco)

# The config file learns which components this build has and which targets each one holds.
set(PULSELOCO_PACKAGE_TARGET_LISTS "")
foreach(package_component ${PULSELOCO_BUILT_PACKAGE_COMPONENTS})
  string(APPEND PULSELOCO_PACKAGE_TARGET_LISTS
    "set(_pulseloco_targets_${package_component} ${PULSELOCO_PACKAGE_TARGETS_${package_component}})\n")
endforeach()
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
