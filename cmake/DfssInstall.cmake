# Installs the library, the public headers and an exported dfss::dfss CMake package.
include(CMakePackageConfigHelpers)

install(TARGETS dfss EXPORT dfssTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dfss DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT dfssTargets NAMESPACE dfss:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dfss)
# The LibTorch operator library has its own export set: find_package(dfss) loads it only when the
# consumer's Torch is found too (its targets link Torch's `torch` target).
if(DFSS_HAVE_TORCH)
  install(TARGETS dfss_torch EXPORT dfssTorchTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(EXPORT dfssTorchTargets NAMESPACE dfss:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dfss)
endif()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dfssConfig.cmake.in
  ${PROJECT_BINARY_DIR}/dfssConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dfss)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dfssConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dfssConfig.cmake ${PROJECT_BINARY_DIR}/dfssConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dfss)
